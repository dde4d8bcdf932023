"""Three nodes on one PostgreSQL run the same schedule: every tick creates exactly one task."""

import itertools
import re
from collections import Counter
from datetime import datetime

import pytest

from .conftest import Daemon
from .pg_fleet import Fleet

pytestmark = pytest.mark.e2e
FIRED = re.compile(r"schedule every-second fired for \S+: task (\w+)$", re.MULTILINE)


def fired(*nodes: Daemon) -> Counter[str]:
    """How many of the nodes' logs say they fired each task of the schedule (one line per task a tick made)."""
    return Counter(task_id for node in nodes for task_id in FIRED.findall(node.log_path.read_text(errors="replace")))


def test_three_nodes_fire_each_of_ten_ticks_exactly_once(fleet: Fleet) -> None:
    a, b, c = (fleet.add(n) for n in ("a", "b", "c"))
    fleet.start(a, b, c)
    created = a.post("/v1/schedules", {"name": "every-second", "type": "noop", "every_s": 1})
    assert created.status == 201, created

    def ticks() -> list[str]:
        rows = fleet.q("SELECT idempotency_key FROM tasks WHERE idempotency_key LIKE 'schedule:every-second:%'")
        return [r[0] for r in rows]

    fleet.wait("ten ticks", lambda: len(ticks()) >= 10, timeout_s=30)
    keys = ticks()
    assert len(keys) == len(set(keys)), "a tick created two tasks"
    seconds = sorted(datetime.fromisoformat(k.split(":", 2)[2]).timestamp() for k in keys)
    assert all(b - a == 1.0 for a, b in itertools.pairwise(seconds)), "a tick was skipped"
    # Each tick's task is one node's: that node says it fired it (its log, beside its events), no other does.
    ids = {r[0] for r in fleet.q("SELECT id FROM tasks WHERE idempotency_key = ANY($1::text[])", keys)}
    fleet.wait("every tick's task in the log of the node that fired it", lambda: ids <= set(fired(a, b, c)))
    said = fired(a, b, c)
    assert {task_id: n for task_id, n in said.items() if n > 1} == {}, "two nodes fired one tick"
    stored = {r[0] for r in fleet.q("SELECT id FROM tasks WHERE idempotency_key LIKE 'schedule:every-second:%'")}
    assert set(said) <= stored, "a node said it fired a task the store does not hold"
    for d in (a, b, c):  # every node sees the one schedule and its last run
        (schedule,) = d.get("/v1/schedules").body["schedules"]
        assert schedule["last_task_id"] is not None
