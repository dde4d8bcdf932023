"""A node killed mid-task on PostgreSQL, with the default lease, reconciler and retry settings: its task
runs again on the survivor, once, never with two live leases. How soon it does (docs/postgresql.md says
within 10 s) is bench/recovery.py's figure: tests assert no wall-clock time."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from .pg_fleet import Fleet

pytestmark = pytest.mark.e2e

HANG_S = 60.0  # only so that a rerun that never comes fails the test instead of hanging it
DEFAULTS: dict[str, dict[str, Any]] = {
    "lease": {"duration_s": 30.0, "renew_every_s": 10.0}, "reconciler": {"interval_s": 5.0},
    "retry": {"backoff_base_s": 2.0, "backoff_max_s": 300.0, "max_attempts": 3},
    "pool": {"min_workers": 2, "max_workers": 4, "poll_interval_s": 2.0, "drain_timeout_s": 1.0}}


class LiveLeases:
    """Samples the attempts table behind the daemons' backs: the most live attempts one task ever had."""

    def __init__(self, of: Fleet, task_id: str) -> None:
        self._fleet, self._task_id = of, task_id
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            (live,), = self._fleet.q("SELECT count(*) FROM attempts WHERE task_id = $1 AND status IN "
                                     "('leased', 'running')", self._task_id)
            self.most = max(self.most, live)
            time.sleep(0.05)

    def __enter__(self) -> LiveLeases:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def test_kill_9_of_a_node_mid_task_its_task_runs_again_on_the_other(fleet: Fleet) -> None:
    _killed_mid_task(fleet, DEFAULTS)


def test_with_a_shorter_node_heartbeat_the_task_runs_again_on_the_other(fleet: Fleet) -> None:
    """node.heartbeat_s = 0.5: gone after 1.5 s, looked for every second (bench/recovery.py times it)."""
    _killed_mid_task(fleet, {**DEFAULTS, "node": {"heartbeat_s": 0.5}})


def _killed_mid_task(fleet: Fleet, settings: dict[str, dict[str, Any]]) -> None:
    """Kill -9 the node running a task mid-way; check how it ran again."""
    a, b = fleet.add("a", **settings), fleet.add("b", **settings)  # type: ignore[arg-type]
    fleet.start(a, b)
    (task_id,) = fleet.submit("append", 1, via=[a], seconds=12.0)
    (_, first), = fleet.wait("the task running", lambda: fleet.live_attempts("a") or fleet.live_attempts("b"))
    (victim_id,), = fleet.q("SELECT node_id FROM attempts WHERE id = $1", first)
    victim, survivor = (a, b) if victim_id == "a" else (b, a)
    survivor_id = "b" if victim_id == "a" else "a"
    time.sleep(2.0)  # mid-task
    with LiveLeases(fleet, task_id) as leases:
        victim.kill()
        dead_at = time.time()  # the victim reaped: nothing it stamps can come later
        fleet.wait("the task running again on the survivor", lambda: fleet.live_attempts(survivor_id),
                   timeout_s=HANG_S)
        fleet.wait("the task completed", lambda: fleet.completed([task_id]), timeout_s=HANG_S)
    rows = fleet.q("SELECT id, node_id, status, number, started_at, finished_at FROM attempts WHERE task_id = $1 "
                   "ORDER BY number", task_id)
    assert [(r[1], r[2], r[3]) for r in rows] == [(victim_id, "expired", 1), (survivor_id, "succeeded", 2)], rows
    (_, _, _, _, started, ended), (_, _, _, _, again, _) = rows
    # ended when the node was last heard of (a heartbeat before it died), not when the survivor noticed
    assert started < ended <= dead_at < again, (started, ended, dead_at, again)
    assert leases.most == 1, "two live leases on one task"
    fleet.assert_no_overlapping_attempts()
    gone = [line for line in survivor.log(200).splitlines() if f"node {victim_id} is gone" in line]
    assert len(gone) == 1 and "1 of its attempts expired" in gone[0], gone
