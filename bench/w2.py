"""W2: many short sleeps on a full pool against the ideal of perfect packing.

--tasks sleep tasks of --seconds each, submitted as one batch to a daemon with pool.min_workers =
max_workers = --workers. Wall = first submit .. all completed seen (GET /v1/pool every 10 ms);
ideal = tasks * seconds / workers. Median of --runs runs on one daemon (the queue is empty between).
CPU per task of the event loop's thread and of all other threads (the SQLite writer and readers), from
/proc: the wall's margin over the ideal grows with the loop's CPU per task (tasks that end together
queue behind one another's bookkeeping), and CPU time is far steadier on this machine than the wall.
The daemon runs at the shipped defaults (log level info, claim_batch 32) but for the pool's size.

Then the same tasks on pgqueuer and dramatiq, each with an idle worker at concurrency --workers
(see peers.py), median of --runs each; the overhead rows compare (wall - ideal) with the peers'
(the goal: tidepool's at most 0.8 x dramatiq's). --peers= leaves them out.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import peers
from _harness import Figure, arguments, median, report, reproduce, running, spread, temp_dir, thread_cpu_s

DEFAULTS: dict[str, Any] = {"tasks": 2000, "seconds": 0.05, "workers": 50, "runs": 3,
                            "peers": ",".join(peers.PEERS)}


def peer_figures(args: Any, ideal: float, wall: float) -> list[Figure]:
    """Each peer's wall / ideal on the same tasks, and tidepool's overhead over the ideal against its."""
    b, figures, ratios = "w2", [], []
    for peer in filter(None, args.peers.split(",")):
        walls, reason = [], ""
        for _ in range(args.runs):
            got = peers.w2(peer, args.tasks, args.seconds, args.workers)
            if isinstance(got, peers.Skipped):
                reason = got.reason
                break
            walls.append(got)
        peer_wall = median(walls) if walls else math.nan
        figures.append(Figure(b, f"{peer} {peers.version(peer)}, wall / ideal", peer_wall / ideal, "x",
                              reason or f"{spread([w / ideal for w in walls], 3)}; first enqueue .. queue seen empty"))
        ratios.append(Figure(b, f"tidepool / {peer}, overhead over the ideal", (wall - ideal) / (peer_wall - ideal),
                             "x", reason or ("the goal: at most 0.8" if peer == "dramatiq" else "")))
    return figures + ratios


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    ideal = args.tasks * args.seconds / args.workers
    walls, spans, loop_us, others_us = [], [], [], []
    overrides = {"pool": {"min_workers": args.workers, "max_workers": args.workers}}
    with temp_dir("w2") as tmp, running(tmp, overrides=overrides) as daemon:
        for run in range(args.runs):
            body = [{"type": "sleep", "payload": {"seconds": args.seconds}}] * args.tasks
            before = thread_cpu_s(daemon.pid)
            started = time.monotonic()
            ids = daemon.submit_batch(body)
            walls.append(daemon.wait_drained(poll_s=0.01) - started)
            used = {tid: s - before.get(tid, 0.0) for tid, s in thread_cpu_s(daemon.pid).items()}
            loop_us.append(1e6 * used.pop(daemon.pid, 0.0) / args.tasks)  # the main thread runs the event loop
            others_us.append(1e6 * sum(used.values()) / args.tasks)
            marks = ",".join("?" * len(ids))
            (done, first, last), = daemon.query(
                f"SELECT count(*), min(created_at), max(finished_at) FROM tasks "
                f"WHERE state = 'completed' AND id IN ({marks})", ids)
            if done != args.tasks:
                raise RuntimeError(f"run {run + 1}: {done} of {args.tasks} completed: {daemon.log_tail()}")
            spans.append(last - first)
            print(f"  run {run + 1}/{args.runs}: wall {walls[-1]:.3f}s, stored span {spans[-1]:.3f}s",
                  file=sys.stderr, flush=True)
    b, wall = "w2", median(walls)
    figures = [
        Figure(b, "wall, first submit .. all completed", wall, "s", spread(walls, 3)),
        Figure(b, "ideal (tasks * seconds / workers)", ideal, "s"),
        Figure(b, "wall / ideal", wall / ideal, "x",
               f"{spread([w / ideal for w in walls], 3)}; tidepool at the shipped defaults"),
        Figure(b, "stored span, created_at .. last finished_at", median(spans), "s", spread(spans, 3)),
        Figure(b, "tasks completed per second", args.tasks / wall, "tasks/s"),
        Figure(b, "CPU per task, event loop thread", median(loop_us), "µs", f"{spread(loop_us)}; from /proc"),
        Figure(b, "CPU per task, other threads", median(others_us), "µs",
               f"{spread(others_us)}; the SQLite writer and readers"),
        *peer_figures(args, ideal, wall),
    ]
    report(f"w2: {args.tasks} x {args.seconds * 1000:.0f} ms sleeps at {args.workers} workers", figures,
           reproduce("w2.py", args, DEFAULTS), args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
