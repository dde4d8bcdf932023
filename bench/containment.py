"""Containment's costs: starting a command with network = "none", and one disk_mb poll of a large work directory.

A `true` command is run through the command runner (spawn, watch, kill) one at a time, plain and with a
network namespace of its own (the launcher: a short Python program that makes the namespace, brings its
loopback up and execs the command). The disk watch's walk is timed on a work directory of `files` files of
4 KiB in 100 directories: that is what one poll costs, in a worker thread, while such a command runs.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

from _harness import Figure, arguments, median, report, reproduce, spread, temp_dir
from tidepool.plugins.command import CommandLimits, run_command
from tidepool.plugins.command.disk import used_bytes
from tidepool.plugins.command.spawn import Confinement

DEFAULTS = {"commands": 100, "files": 10_000, "walks": 20}


async def start_cost(workdir: Path, n: int, confinement: Confinement) -> float:
    """Seconds per `true` command, start to reaped."""
    true = shutil.which("true") or "/bin/true"
    started = time.perf_counter()
    for _ in range(n):
        await run_command([true], env={"PATH": os.defpath}, workdir=workdir, limits=CommandLimits(),
                          kill_grace_s=1.0, confinement=confinement)
    return (time.perf_counter() - started) / n


def many_files(root: Path, n: int) -> None:
    for i in range(n):
        folder = root / f"d{i % 100:02d}"
        folder.mkdir(exist_ok=True)
        (folder / f"f{i}").write_bytes(b"x" * 4096)


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    with temp_dir("containment") as tmp:
        workdir = tmp / "work" / "attempt"
        workdir.mkdir(parents=True)
        plain, isolated = [], []
        for _ in range(3):  # alternated, so that a slower minute weighs on both
            plain.append(asyncio.run(start_cost(workdir, args.commands, Confinement())))
            isolated.append(asyncio.run(start_cost(workdir, args.commands, Confinement(network_none=True))))
        big = tmp / "big"
        big.mkdir()
        many_files(big, args.files)
        walks = []
        for _ in range(args.walks):
            started = time.perf_counter()
            used_bytes(big)
            walks.append(time.perf_counter() - started)
    b = "containment"
    plain_ms, isolated_ms = [1000 * v for v in plain], [1000 * v for v in isolated]
    costs = [i - p for p, i in zip(plain_ms, isolated_ms, strict=True)]
    ratios = [i / p for p, i in zip(plain_ms, isolated_ms, strict=True)]
    each = f"of {args.commands} commands each"
    figures = [
        Figure(b, "a `true` command, network host", median(plain_ms), "ms", f"{spread(plain_ms, 1)} {each}"),
        Figure(b, "a `true` command, network none", median(isolated_ms), "ms", f"{spread(isolated_ms, 1)} {each}"),
        Figure(b, "network none's start-up cost", median(costs), "ms", f"per command, {spread(costs, 1)}"),
        Figure(b, "network none / host", median(ratios), "x", f"per run, {spread(ratios, 2)}"),
        Figure(b, f"disk_mb poll, {args.files:,} files", 1000 * median(walks), "ms",
               f"{spread([1000 * w for w in walks], 1)} walks, in a worker thread"),
    ]
    report("containment: network = \"none\" at start-up, disk_mb per poll", figures,
           reproduce("containment.py", args, DEFAULTS), args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
