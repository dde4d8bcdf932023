"""A/B: one benchmark run against two trees of tidepool in turn, round after round, on this machine now.

    .venv/bin/python bench/ab.py A_REF B_REF [--rounds N] -- SCRIPT [ARGS...]

Each ref's `src/` is taken with `git archive` into a temporary directory; a round runs SCRIPT (a bench of
this checkout, the same for both) once with A's tree first on PYTHONPATH, then once with B's, alternating
which goes first, so that the machine's drift (its speed moves ~3x between days, and with other work
within minutes) falls on both alike. Every daemon a bench starts is `python -m tidepool`, so it runs the
tree of its turn. For each figure it prints A's and B's medians with min-max, and the median of the
per-round ratios B / A, the one number that the drift between rounds does not move.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import REPO, median


def tree(ref: str, into: Path) -> Path:
    """`ref`'s src/ in `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref, "src"], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def run_once(script: list[str], src: Path, summary: Path) -> dict[str, tuple[float, str]]:
    summary.write_text("")
    env = {**os.environ, "PYTHONPATH": str(src)}
    code = subprocess.call([sys.executable, *script, "--summary", str(summary)], cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL)
    if code != 0:
        print(f"  !! {' '.join(script)} exited {code} with {src}", flush=True)
    figures = [json.loads(line) for line in summary.read_text().splitlines() if line.strip()]
    return {f["name"]: (f["value"], f["unit"]) for f in figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--rounds", type=int, default=4)
    argv = sys.argv[1:]
    if "--" not in argv:
        parser.error("give the bench after --: ab.py A B [--rounds N] -- bench/SCRIPT.py [ARGS]")
    cut = argv.index("--")
    args, script = parser.parse_args(argv[:cut]), argv[cut + 1:]
    seen: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}
    units: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="tidepool-ab-") as tmp:
        srcs = {side: tree(getattr(args, side), Path(tmp) / side) for side in ("a", "b")}
        summary = Path(tmp) / "summary.jsonl"
        for n in range(args.rounds):
            order = ("a", "b") if n % 2 == 0 else ("b", "a")
            for side in order:
                for name, (value, unit) in run_once(script, srcs[side], summary).items():
                    seen[side].setdefault(name, []).append(value)
                    units[name] = unit
            print(f"  round {n + 1}/{args.rounds} done ({' then '.join(order)})", flush=True)
    print(f"\n== A/B of {' '.join(script)}: A = {args.a}, B = {args.b}, {args.rounds} rounds, alternated")
    print(f"  {'figure':<46} {'A median (min-max)':>28} {'B median (min-max)':>28} {'B/A':>6}")
    for name in units:
        a, b = seen["a"].get(name, []), seen["b"].get(name, [])
        if not a or not b:
            continue
        ratios = [y / x for x, y in zip(a, b, strict=False) if x]
        ratio = f"{median(ratios):.2f}" if ratios else "-"
        print(f"  {name:<46} {_spread(a):>28} {_spread(b):>28} {ratio:>6}  {units[name]}")
    return 0


def _spread(values: list[float]) -> str:
    return f"{median(values):,.4g} ({min(values):,.4g}-{max(values):,.4g})"


if __name__ == "__main__":
    sys.exit(main())
