"""Elasticity: how fast the pool grows to max_workers under a burst and shrinks back, and idle CPU.

pool.min_workers = --min, max_workers = --max, idle_timeout_s = --idle. A burst of --tasks sleep
tasks of --seconds each goes in as one batch while GET /v1/pool is polled every 10 ms:
  grow    first submit .. workers == max
  shrink  end of the burst's work (nothing queued or running, busy 0) .. workers == min
          (expected: about idle_timeout_s)
Then the pool is left alone for --idle-window seconds and the daemon's CPU time (psutil
cpu_times, user + system) over that window is printed as a percentage of one core. Each of --runs runs
is a fresh daemon; a figure is the median of the runs, with their min and max.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import psutil

from _harness import Daemon, Figure, arguments, median, report, reproduce, running, spread, temp_dir

DEFAULTS: dict[str, Any] = {"min": 2, "max": 16, "idle": 2.0, "tasks": 64, "seconds": 1.0,
                            "idle_window": 10.0, "runs": 3}


def poll_until(daemon: Daemon, done: Any, *, timeout_s: float, poll_s: float = 0.01) -> tuple[float, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool = daemon.pool()
        if done(pool):
            return time.monotonic(), pool
        time.sleep(poll_s)
    raise RuntimeError(f"pool condition not reached within {timeout_s}s: {daemon.pool()}")


def one_run(args: Any) -> dict[str, float]:
    """Grow (ms), shrink (s), the burst's work (s), idle CPU (% of a core) and the peak, on a fresh daemon."""
    overrides = {"pool": {"min_workers": args.min, "max_workers": args.max, "idle_timeout_s": args.idle}}
    with temp_dir("elasticity") as tmp, running(tmp, overrides=overrides) as daemon:
        poll_until(daemon, lambda p: p["workers"] == args.min, timeout_s=10)
        body = [{"type": "sleep", "payload": {"seconds": args.seconds}}] * args.tasks
        burst = time.monotonic()
        daemon.submit_batch(body)
        grown, _ = poll_until(daemon, lambda p: p["workers"] >= args.max, timeout_s=30)
        peak = daemon.pool()["workers"]
        work_done, _ = poll_until(daemon, lambda p: p["busy"] == 0 and not any(p["queue"].values()),
                                  timeout_s=120)
        shrunk, _ = poll_until(daemon, lambda p: p["workers"] == args.min, timeout_s=args.idle * 5 + 10)
        (done,), = daemon.query("SELECT count(*) FROM tasks WHERE state = 'completed'")
        if done != args.tasks:
            raise RuntimeError(f"{done} of {args.tasks} tasks completed: {daemon.log_tail()}")
        process = psutil.Process(daemon.pid)
        before, t0 = process.cpu_times(), time.monotonic()
        time.sleep(args.idle_window)
        after, t1 = process.cpu_times(), time.monotonic()
        idle_cpu = ((after.user - before.user) + (after.system - before.system)) / (t1 - t0)
    return {"grow": 1000 * (grown - burst), "shrink": shrunk - work_done, "work": work_done - burst,
            "idle": 100 * idle_cpu, "peak": peak}


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    got: dict[str, list[float]] = {}
    for _ in range(args.runs):
        for key, value in one_run(args).items():
            got.setdefault(key, []).append(value)
    b, m = "elasticity", {k: median(v) for k, v in got.items()}
    figures = [
        Figure(b, f"grow: burst .. workers == {args.max}", m["grow"], "ms",
               f"{spread(got['grow'])}; {args.tasks} x {args.seconds}s sleeps; peak {max(got['peak']):.0f} workers"),
        Figure(b, f"shrink: work done .. workers == {args.min}", m["shrink"], "s",
               f"{spread(got['shrink'], 2)}; idle_timeout_s = {args.idle}"),
        Figure(b, f"burst work time ({args.tasks} x {args.seconds}s)", m["work"], "s",
               f"{spread(got['work'], 2)}; ideal {args.tasks * args.seconds / args.max:.1f}s at {args.max} workers"),
        Figure(b, f"idle CPU over {args.idle_window:.0f}s", m["idle"], "%",
               f"{spread(got['idle'], 2)}; of one core, user + system"),
    ]
    report(f"elasticity: min {args.min}, max {args.max}, idle_timeout_s {args.idle}", figures,
           reproduce("elasticity.py", args, DEFAULTS), args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
