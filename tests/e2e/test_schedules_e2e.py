"""Schedules on the real daemon: ticks fire on time, and a restart across ticks follows catch_up."""

import asyncio
import itertools
import time
from collections.abc import Callable
from datetime import datetime

import aiohttp
import pytest

from .api_helpers import EventStream
from .conftest import Daemon

pytestmark = pytest.mark.e2e


def tick_of(task: dict) -> float:  # type: ignore[type-arg]
    return datetime.fromisoformat(task["idempotency_key"].split(":", 2)[2]).timestamp()


def scheduled(daemon: Daemon, name: str) -> list[dict]:  # type: ignore[type-arg]
    tasks = daemon.get("/v1/tasks?limit=1000").body["tasks"]
    return [t for t in tasks if (t["idempotency_key"] or "").startswith(f"schedule:{name}:")]


def test_an_every_second_schedule_fires_each_tick_once(daemon: Daemon) -> None:
    created = daemon.post("/v1/schedules", {"name": "tick", "type": "noop", "every_s": 1})
    assert created.status == 201, created.body
    daemon.wait_for("three ticks", lambda: len(scheduled(daemon, "tick")) >= 3, timeout_s=10)
    ticks = sorted(tick_of(t) for t in scheduled(daemon, "tick"))
    assert len(ticks) == len(set(ticks))
    assert all(b - a == 1.0 for a, b in itertools.pairwise(ticks))  # one task per tick, none missed
    listing = daemon.get("/v1/schedules").body["schedules"]
    assert listing[0]["name"] == "tick" and listing[0]["last_task_id"] is not None


def test_a_scheduled_task_is_created_like_a_submitted_one_in_events_and_metrics(daemon: Daemon) -> None:
    assert daemon.post("/v1/schedules", {"name": "tick", "type": "noop", "every_s": 1}).status == 201
    daemon.wait_for("two ticks", lambda: len(scheduled(daemon, "tick")) >= 2, timeout_s=10)
    paused = daemon.post("/v1/schedules/tick/pause")
    assert paused.status == 200 and paused.body["last_task_state"] is not None, "as GET /v1/schedules says it"
    time.sleep(0.5)  # a pass in flight when the pause landed
    tasks = scheduled(daemon, "tick")
    metrics = daemon.get("/metrics").body
    assert f'tidepool_tasks_created_total{{type="noop"}} {float(len(tasks))}' in metrics, metrics
    first = min(tasks, key=lambda t: t["created_at"])

    async def replayed() -> list[str]:  # everything the ring holds of the first scheduled task
        async with aiohttp.ClientSession() as session:
            stream = await EventStream.open(session, daemon, last_id=0, task_id=first["id"])
            try:
                return [e.event for e in await stream.until(lambda e: e.event == "task.finished")]
            finally:
                stream.close()

    names = asyncio.run(replayed())
    assert names[:3] == ["task.created", "schedule.fired", "task.leased"], names


def test_a_scheduled_task_gets_its_type_s_attempt_budget(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon({"types.once": {"plugins": ["noop"], "max_attempts": 1}})
    daemon.start()
    assert daemon.post("/v1/schedules", {"name": "once", "type": "once", "every_s": 1}).status == 201
    daemon.wait_for("a tick", lambda: scheduled(daemon, "once"), timeout_s=10)
    assert {t["max_attempts"] for t in scheduled(daemon, "once")} == {1}  # not retry.max_attempts (3)


@pytest.mark.parametrize("catch_up", ["all", "last", "none"])
def test_restart_across_ticks_follows_catch_up(make_daemon: Callable[..., Daemon], catch_up: str) -> None:
    daemon = make_daemon()
    daemon.start()
    body = {"name": "every2", "type": "noop", "every_s": 2, "catch_up": catch_up}
    assert daemon.post("/v1/schedules", body).status == 201
    daemon.wait_for("a first tick", lambda: scheduled(daemon, "every2"), timeout_s=10)
    assert daemon.stop() == 0
    stopped_at = time.time()
    time.sleep(5.0)  # two or three ticks pass with no daemon to fire them
    restarting_at = time.time()
    daemon.start()
    time.sleep(1.0)
    tasks = scheduled(daemon, "every2")
    ticks = [tick_of(t) for t in tasks]
    assert len(ticks) == len(set(ticks)), "a tick fired twice"
    after = [t for t in tasks if created(t) > restarting_at]
    first_fire = min(created(t) for t in after) if after else time.time()
    due = [k * 2.0 for k in range(int(stopped_at // 2) + 1, int(first_fire // 2) + 1)]  # ticks due at first fire
    caught = sorted(tick_of(t) for t in after if tick_of(t) <= first_fire)
    assert len(due) >= 2
    if catch_up == "all":
        assert caught == due
    elif catch_up == "last":
        assert caught == due[-1:]
    else:  # only a tick that is on time (within half a period) may fire
        assert caught in ([], due[-1:])
        assert not caught or first_fire - caught[0] <= 1.0


def created(task: dict) -> float:  # type: ignore[type-arg]
    return datetime.fromisoformat(task["created_at"].replace("Z", "+00:00")).timestamp()
