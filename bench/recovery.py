"""Recovery: how long the tasks of a node killed mid-task wait to run again, on another node or after a restart.

Rows (--rows picks some), each the median of --runs with min and max:
  failover two nodes on one PostgreSQL schema (of the server at --url, dropped afterwards) with the settings
           of tests/e2e/test_pg_failover.py (the shipped lease, reconciler and retry settings; pools of 2-4);
           a `sleep` task of 12 s is submitted, and 2 s after it started the node running it is killed
           with SIGKILL. rerun: the kill .. the second attempt's start on the survivor, as the store
           recorded it; ended: the first attempt's end (the victim's last heartbeat, not when the survivor
           noticed) minus the kill, at most 0: how long before the kill the victim was last heard of.
           Both at the shipped node.heartbeat_s and at 0.5 s (--heartbeats); docs/postgresql.md states
           the bound at the defaults: 10 s.
  restart  one daemon on SQLite (tests/e2e/test_crash_recovery.py's settings: a 30 s lease, 50 workers)
           with 50 `sleep` tasks of 5 s running is killed with SIGKILL and started again; the start ..
           all 50 completed (each run again once, not after its lease ran out), seen by polling the API.
Figures only: nothing here passes or fails on time; the tests keep what must happen (one rerun, never two
live leases, not after the lease) and only a bound that stops them hanging.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from _harness import Daemon, Figure, arguments, median, report, reproduce, spread, temp_dir
from pg_throughput import fetch, schema

DEFAULTS: dict[str, Any] = {"rows": "failover,restart", "runs": 3, "url": "postgresql://postgres@127.0.0.1:5432/test",
                            "heartbeats": "default,0.5"}
RESTART = {"lease": {"duration_s": 30.0, "renew_every_s": 10.0}, "retry": {"backoff_base_s": 0.2},
           "pool": {"max_workers": 50}}  # tests/e2e/test_crash_recovery.py's
SETTINGS: dict[str, dict[str, Any]] = {  # tests/e2e/test_pg_failover.py's DEFAULTS
    "lease": {"duration_s": 30.0, "renew_every_s": 10.0}, "reconciler": {"interval_s": 5.0},
    "retry": {"backoff_base_s": 2.0, "backoff_max_s": 300.0, "max_attempts": 3},
    "pool": {"min_workers": 2, "max_workers": 4, "poll_interval_s": 2.0, "drain_timeout_s": 1.0}}
GIVE_UP_S = 120.0


def killed_mid_task(tmp: Path, url: str, heartbeat_s: float | None) -> tuple[float, float]:
    """(kill .. rerun started, first attempt ended - kill), in seconds, on a fresh schema."""
    settings = {**SETTINGS, **({} if heartbeat_s is None else {"node": {"heartbeat_s": heartbeat_s}})}
    with schema(url) as s:
        nodes = {name: Daemon(tmp / name, overrides={**settings, "node": {**settings.get("node", {}), "id": name},
                                                     "store": {"url": f"{url}?schema={s}"}}) for name in ("a", "b")}
        try:
            for node in nodes.values():  # one after another: the first creates the schema
                node.start(timeout_s=60)
            task_id = nodes["a"].post("/v1/tasks", {"type": "sleep", "payload": {"seconds": 12.0}})["id"]
            victim_id = _wait(lambda: fetch(url, s, "SELECT node_id FROM attempts WHERE task_id = $1 AND status "
                                                    "= 'running'", task_id), "the task running")[0][0]
            time.sleep(2.0)  # mid-task
            victim = nodes[victim_id]
            killed_at = time.time()
            victim.kill()
            rows = _wait(lambda: fetch(url, s, "SELECT started_at FROM attempts WHERE task_id = $1 AND number = 2",
                                       task_id), "the task running again on the survivor")
            (ended,), = fetch(url, s, "SELECT finished_at FROM attempts WHERE task_id = $1 AND number = 1", task_id)
        finally:
            for node in nodes.values():
                node.kill()
    return float(rows[0][0]) - killed_at, float(ended) - killed_at


def _wait(check: Any, what: str) -> Any:
    deadline = time.monotonic() + GIVE_UP_S
    while not (got := check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {GIVE_UP_S:g} s: {what}")
        time.sleep(0.02)
    return got


def restarted(tmp: Path) -> float:
    """Seconds from the restart of a daemon killed with 50 tasks running to all 50 completed."""
    daemon = Daemon(tmp, overrides=RESTART)
    daemon.start(timeout_s=60)
    try:
        ids = daemon.submit_batch([{"type": "sleep", "payload": {"seconds": 5}}] * 50)
        _wait(lambda: daemon.pool()["busy"] == 50, "50 tasks running")
        daemon.kill()
        started = time.monotonic()
        daemon.start(timeout_s=60)
        _wait(lambda: daemon.query("SELECT count(*) FROM tasks WHERE state = 'completed'")[0][0] == len(ids),
              "every task completed after the restart")
        done = time.monotonic() - started
        (twice,), = daemon.query("SELECT count(*) FROM tasks WHERE attempt <> 2")
        if twice:
            raise RuntimeError(f"restart: {twice} tasks did not run exactly twice")
        return done
    finally:
        daemon.kill()


def restart_rows(args: Any) -> list[Figure]:
    took = []
    for run in range(args.runs):
        with temp_dir("recovery-restart") as tmp:
            took.append(restarted(tmp))
        print(f"  restart run {run + 1}/{args.runs}: all completed {took[-1]:.2f} s after the restart",
              file=sys.stderr, flush=True)
    return [Figure("recovery", "SIGKILL, 50 running, restart .. all completed", median(took), "s",
                   f"{spread(took, 2)}; 5 s tasks, a 30 s lease: not waited for")]


def rows(args: Any, heartbeat: str) -> list[Figure]:
    heartbeat_s = None if heartbeat == "default" else float(heartbeat)
    rerun, ended = [], []
    for run in range(args.runs):
        with temp_dir("recovery") as tmp:
            again, last_heard = killed_mid_task(tmp, args.url, heartbeat_s)
        rerun.append(again)
        ended.append(last_heard)
        print(f"  recovery run {run + 1}/{args.runs}, heartbeat {heartbeat}: rerun {again:.2f} s after the kill",
              file=sys.stderr, flush=True)
    b, hb = "recovery", "node.heartbeat_s shipped" if heartbeat_s is None else f"node.heartbeat_s {heartbeat_s:g}"
    bound = "; docs/postgresql.md: within 10 s" if heartbeat_s is None else ""
    return [
        Figure(b, f"kill -9 mid-task .. rerun, {hb}", median(rerun), "s", f"{spread(rerun, 2)}{bound}"),
        Figure(b, f"first attempt's end - kill, {hb}", median(ended), "s",
               f"{spread(ended, 2)}; its last heartbeat, before the kill"),
    ]



def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    wanted = set(args.rows.split(","))
    figures = []
    if "failover" in wanted:
        figures += [f for heartbeat in args.heartbeats.split(",") for f in rows(args, heartbeat)]
    if "restart" in wanted:
        figures += restart_rows(args)
    report("recovery: a node killed mid-task (PostgreSQL, two nodes; SQLite, a restart)", figures,
           reproduce("recovery.py", args, DEFAULTS), args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
