"""Three nodes on one PostgreSQL run the same schedule: every tick creates exactly one task."""

import itertools
from datetime import datetime

import pytest

from .test_pg_cluster import Fleet, fleet  # noqa: F401  (the fixture)

pytestmark = pytest.mark.e2e


def test_three_nodes_fire_each_of_ten_ticks_exactly_once(fleet: Fleet) -> None:  # noqa: F811
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
    fired_by = {r[0] for r in fleet.q("SELECT DISTINCT node_id FROM attempts")}
    assert fired_by <= {"a", "b", "c"}
    for d in (a, b, c):  # every node sees the one schedule and its last run
        (schedule,) = d.get("/v1/schedules").body["schedules"]
        assert schedule["last_task_id"] is not None
