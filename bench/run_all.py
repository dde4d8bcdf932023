"""Runs every benchmark (what `make bench` calls), each in its own process, then prints a summary table.

Figures only: nothing here passes or fails on time. A benchmark that crashes is reported as such
and the others still run; the exit status is 1 only when one of them could not produce figures, or when
a peer's rows could not be measured: pgqueuer and dramatiq not installed (`make bench` installs the
`bench` extra), or the PostgreSQL (127.0.0.1:5432) and Redis (127.0.0.1:6379) they use as running
services not reachable (checked first, so that a peer's row is never a silent NaN).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
# each takes --summary PATH
BENCHES = ("throughput.py", "latency.py", "w2.py", "elasticity.py", "api_load.py", "pg_throughput.py", "scans.py",
           "gateway.py", "recovery.py", "gateway_fleet.py", "containment.py", "blobs.py")
SERVICES = {"PostgreSQL": ("127.0.0.1", 5432), "Redis": ("127.0.0.1", 6379)}  # peers.py's PG_URL, REDIS_URL


def peers_ready() -> list[str]:
    """What stops a peer's rows: a peer not installed, a service it uses not listening. Printed as found."""
    sys.path.insert(0, str(HERE))
    import peers

    missing = []
    for peer in peers.PEERS:
        found = peers.version(peer)
        print(f"  peer {peer}: {found}", flush=True)
        if found == "not installed":
            missing.append(f"{peer} not installed (make bench installs the bench extra)")
    for service, (host, port) in SERVICES.items():
        try:
            socket.create_connection((host, port), timeout=2.0).close()
            print(f"  service {service} at {host}:{port}: listening", flush=True)
        except OSError as exc:
            print(f"  service {service} at {host}:{port}: {exc}", flush=True)
            missing.append(f"{service} not reachable at {host}:{port} (start it as a service)")
    return missing


def main() -> int:
    print(f"tidepool benchmarks on {platform.node()}: {psutil.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{platform.system()} {platform.release()}, load average {_load()}", flush=True)
    failed, timings = peers_ready(), {}
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
    print("\n== the same as rows of docs/performance.md's table (figure, its runs, the command that printed it)")
    for f in figures:
        value = f["value"]
        shown = "-" if value != value else f"{value:,.1f}" if abs(value) >= 100 else f"{value:,.3g}"
        print(f"| {f['name']} | {shown} {f['unit']} | {f['note']} | `{f.get('command', f['bench'])}` |")
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
