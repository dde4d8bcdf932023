"""Runs every benchmark (what `make bench` calls), each in its own process, then prints a summary table.

Figures only: nothing here passes or fails on time. A benchmark that crashes is reported as such
and the others still run; the exit status is 1 only when one of them could not produce figures.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
# each takes --summary PATH
BENCHES = ("throughput.py", "latency.py", "w2.py", "elasticity.py", "api_load.py", "pg_throughput.py", "scans.py",
           "gateway.py", "containment.py")


def main() -> int:
    print(f"tidepool benchmarks on {platform.node()}: {psutil.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{platform.system()} {platform.release()}, load average {_load()}", flush=True)
    failed, timings = [], {}
    with tempfile.TemporaryDirectory(prefix="tidepool-bench-") as tmp:
        summary = Path(tmp) / "summary.jsonl"
        summary.touch()
        for bench in BENCHES:
            if not (HERE / bench).is_file():
                failed.append(bench)
                print(f"\n!! {bench} is missing; skipped", flush=True)
                continue
            started = time.monotonic()
            code = subprocess.call([sys.executable, str(HERE / bench), "--summary", str(summary)], cwd=HERE.parent)
            timings[bench] = time.monotonic() - started
            if code != 0:
                failed.append(bench)
                print(f"\n!! {bench} exited with status {code}; no figures from it", flush=True)
        figures = [json.loads(line) for line in summary.read_text().splitlines() if line.strip()]
    print("\n== summary")
    print(f"  {'bench':<11} {'figure':<46} {'value':>12} unit")
    for f in figures:
        value = f["value"]
        # NaN (never equal to itself): not measured, the benchmark's own output says why
        shown = "-" if value != value else f"{value:,.1f}" if abs(value) >= 100 else f"{value:,.3g}"
        print(f"  {f['bench']:<11} {f['name']:<46} {shown:>12} {f['unit']}")
    sys.path.insert(0, str(HERE))
    from _harness import fsync_note

    print(f"  durable figures: {fsync_note()}")
    print(f"  load average now {_load()} (other work on this machine skews every figure; compare like with like)")
    print("  run times: " + ", ".join(f"{b} {t:.0f}s" for b, t in timings.items()))
    if failed:
        print(f"  failed: {', '.join(failed)}")
    return 1 if failed else 0


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
