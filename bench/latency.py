"""Pickup latency: tasks submitted one at a time to an idle daemon, each waited for until it has started.

Latency = attempts[0].started_at - created_at, both stamped by the daemon (RFC 3339) as it writes
the submit and the claim: the wake-up and the claim transaction, not the HTTP hop. The client-side
POST round trip is printed beside it.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime
from typing import Any

from _harness import Figure, arguments, fsync_note, percentile, report, reproduce, running, temp_dir

DEFAULTS: dict[str, Any] = {"tasks": 200, "type": "noop"}


def ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    pickup, post = [], []
    with temp_dir("latency") as tmp, running(tmp) as daemon:
        time.sleep(0.5)  # let the start-up claims settle: the daemon is idle
        for _ in range(args.tasks):
            before = time.perf_counter()
            task = daemon.post("/v1/tasks", {"type": args.type})
            post.append(time.perf_counter() - before)
            while not task["attempts"]:
                time.sleep(0.001)
                task = daemon.get(f"/v1/tasks/{task['id']}")
            pickup.append(ts(task["attempts"][0]["started_at"]) - ts(task["created_at"]))
    b, n = "latency", args.tasks
    figures = [
        Figure(b, "pickup p50 (daemon stamps: submit .. claim)", 1000 * percentile(pickup, 50), "ms", f"n={n}"),
        Figure(b, "pickup p99", 1000 * percentile(pickup, 99), "ms", f"n={n}"),
        Figure(b, "pickup max", 1000 * max(pickup), "ms", f"n={n}"),
        Figure(b, "POST /v1/tasks round trip p50", 1000 * percentile(post, 50), "ms", "client side"),
        Figure(b, "POST /v1/tasks round trip p99", 1000 * percentile(post, 99), "ms", "client side"),
    ]
    report(f"latency: {n} {args.type} tasks one at a time, idle daemon (2 baseline workers)", figures,
           reproduce("latency.py", args, DEFAULTS), args.summary, [f"durable figures: {fsync_note()}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
