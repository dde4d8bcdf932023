"""Pickup latency: tasks submitted one at a time to an idle daemon, each waited for until it has started.

Latency = attempts[0].started_at - created_at, both stamped by the daemon (RFC 3339) as it writes
the submit and the claim: the wake-up and the claim transaction, not the HTTP hop. The client-side
POST round trip is printed beside it. Each of --runs runs is a fresh daemon; a figure is the median of
the runs' own percentiles, with their min and max.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime
from typing import Any

from _harness import Figure, arguments, fsync_note, median, percentile, report, reproduce, running, spread, temp_dir

DEFAULTS: dict[str, Any] = {"tasks": 200, "type": "noop", "runs": 3}


def ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def one_run(tasks: int, type_: str) -> tuple[list[float], list[float]]:
    """(pickup, POST round trip) of each task, in seconds, on a fresh idle daemon."""
    pickup, post = [], []
    with temp_dir("latency") as tmp, running(tmp) as daemon:
        time.sleep(0.5)  # let the start-up claims settle: the daemon is idle
        for _ in range(tasks):
            before = time.perf_counter()
            task = daemon.post("/v1/tasks", {"type": type_})
            post.append(time.perf_counter() - before)
            while not task["attempts"]:
                time.sleep(0.001)
                task = daemon.get(f"/v1/tasks/{task['id']}")
            pickup.append(ts(task["attempts"][0]["started_at"]) - ts(task["created_at"]))
    return pickup, post


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    got: dict[str, list[float]] = {"p50": [], "p99": [], "max": [], "post50": [], "post99": []}
    for _ in range(args.runs):
        pickup, post = one_run(args.tasks, args.type)
        for key, value in (("p50", percentile(pickup, 50)), ("p99", percentile(pickup, 99)), ("max", max(pickup)),
                           ("post50", percentile(post, 50)), ("post99", percentile(post, 99))):
            got[key].append(1000 * value)
    b, n = "latency", args.tasks

    def figure(name: str, key: str, note: str) -> Figure:
        return Figure(b, name, median(got[key]), "ms", f"{spread(got[key], 2)}; {note}")

    figures = [
        figure("pickup p50 (daemon stamps: submit .. claim)", "p50", f"n={n} a run"),
        figure("pickup p99", "p99", f"n={n} a run"),
        figure("pickup max", "max", f"n={n} a run"),
        figure("POST /v1/tasks round trip p50", "post50", "client side"),
        figure("POST /v1/tasks round trip p99", "post99", "client side"),
    ]
    report(f"latency: {n} {args.type} tasks one at a time, idle daemon (2 baseline workers)", figures,
           reproduce("latency.py", args, DEFAULTS), args.summary, [f"durable figures: {fsync_note()}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
