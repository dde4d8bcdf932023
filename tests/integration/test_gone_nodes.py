"""A node that stops heartbeating: the survivors expire its attempts as ended when it was last heard of, once,
and only while their own heartbeats go through; the node itself stops its attempts a heartbeat earlier."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import anyio
import pytest

from tidepool.events import EventBus
from tidepool.execution.context import TaskContext
from tidepool.execution.engine import Engine, EngineConfig
from tidepool.execution.leases import LeaseKeeper
from tidepool.lifecycle import RetryPolicy
from tidepool.model import AttemptStatus, ClaimFilter, NewTask, State, Worker
from tidepool.plugins import PluginDef, Registry
from tidepool.settings import TypeSettings
from tidepool.store import Expired, Node
from tidepool.store.sqlite import SqliteStore
from tidepool.upkeep.fleet import HEARTBEAT_S, GoneNodes, fence_after_s, gone_after_s

T0 = 1_700_000_000.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def node(node_id: str, heartbeat_at: float, *, stopped_at: float | None = None) -> Node:
    return Node(node_id, f"{node_id}-1", "host", 1, "0", T0 - 60, heartbeat_at, HEARTBEAT_S, ("noop",), (), 4,
                stopped_at)


class Watch:
    def __init__(self, store: SqliteStore) -> None:
        self.store, self.clock = store, Clock(T0)
        self.reported: list[tuple[list[Expired], str]] = []
        self.others_alive: list[bool] = []
        self.gone = GoneNodes(store, node_id="a", policy=RetryPolicy,
                              report=lambda expired, why: self.reported.append((expired, why)),
                              fleet_seen=self.others_alive.append, clock=self.clock)

    async def beat(self, *node_ids: str) -> None:
        for node_id in node_ids:
            await self.store.save_node(node("a" if node_id == "a" else node_id, self.clock.now))

    async def claim_on_b(self) -> str:
        task, _ = await self.store.add(NewTask("noop"), now=self.clock.now)
        await self.store.claim(Worker("b", "b-1", "b/w1"), ClaimFilter(), limit=1, now=self.clock.now, lease_s=30.0)
        return task.id


@pytest.fixture
def watch(store: SqliteStore) -> Watch:
    return Watch(store)


async def test_a_node_not_heard_of_for_three_heartbeats_has_its_attempts_expired_once(
        watch: Watch, caplog: pytest.LogCaptureFixture) -> None:
    await watch.beat("a", "b")
    task_id = await watch.claim_on_b()
    last_heard = watch.clock.now
    assert await watch.gone.check_once() == {}  # a's own heartbeats have not gone through long enough yet
    for _ in range(3):  # b goes silent; a beats on
        watch.clock.now += HEARTBEAT_S
        await watch.beat("a")
        found = await watch.gone.check_once()
        assert found == {}, "b is not gone before three of its heartbeats"
    watch.clock.now = last_heard + gone_after_s(HEARTBEAT_S) + 0.5
    await watch.beat("a")
    with caplog.at_level(logging.WARNING, logger="tidepool.fleet"):
        assert await watch.gone.check_once() == {"b": 1}
        assert await watch.gone.check_once() == {}, "said once"
    assert watch.others_alive[-2:] == [False, False], "b is not alive: a is alone"
    assert [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()] == [
        "node b is gone: not heard of for 6.5s (since 22:13:20); 1 of its attempts expired"]
    task = await watch.store.get(task_id)
    assert task.state is State.RETRY_WAIT
    (attempt,) = task.attempts
    assert (attempt.status.value, attempt.finished_at) == ("expired", last_heard)
    assert [(e.task_id, why) for expired, why in watch.reported for e in expired] == [(task_id, "node b gone")]


async def test_a_stopped_node_and_one_still_heard_of_are_left_alone(watch: Watch) -> None:
    await watch.beat("a")
    await watch.store.save_node(node("c", T0 - 100, stopped_at=T0 - 100))
    await watch.store.save_node(node("b", T0))
    await watch.claim_on_b()
    for _ in range(5):
        watch.clock.now += HEARTBEAT_S
        await watch.beat("a", "b")
        assert await watch.gone.check_once() == {}


async def test_after_its_own_outage_a_node_judges_nobody_until_the_others_could_be_heard_of_again(
        watch: Watch) -> None:
    await watch.beat("a", "b")
    await watch.claim_on_b()
    watch.clock.now += 4 * gone_after_s(HEARTBEAT_S)  # the store was away for everyone
    await watch.beat("a")
    assert await watch.gone.check_once() == {}, "b's row is as stale as ours was: no evidence against it"
    watch.clock.now += HEARTBEAT_S
    await watch.beat("a", "b")
    assert await watch.gone.check_once() == {}


async def test_a_node_whose_heartbeat_goes_unsaved_stops_its_attempts_a_heartbeat_before_it_is_called_gone(
        store: SqliteStore) -> None:
    monotonic = Clock(100.0)
    fences: list[float] = []
    keeper = LeaseKeeper(store, lease_s=30.0, renew_every_s=10.0, flush_every_s=0.01,
                         fence_after_s=fence_after_s(HEARTBEAT_S), on_fence=lambda: fences.append(monotonic.now),
                         clock=Clock(T0), monotonic=monotonic)
    await store.add(NewTask("noop"), now=T0)
    (lease,) = await store.claim(Worker("a", "a-1", "a/w1"), ClaimFilter(), limit=1, now=T0, lease_s=30.0)
    held = keeper.hold(lease.lease)
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        keeper.heard(monotonic.now)
        monotonic.now += fence_after_s(HEARTBEAT_S) - 0.1
        await anyio.sleep(0.05)
        assert held.why is None and not keeper.fencing(), "heard of recently enough"
        keeper.fleet_seen(False)
        monotonic.now += 0.2
        await anyio.sleep(0.05)
        assert held.why is None, "alone in the fleet: nobody could take the task over, so it runs on"
        keeper.fleet_seen(True)
        await anyio.sleep(0.05)
        assert held.why == "fenced" and held.scope.cancel_called
        assert len(fences) == 1, "told once, before the stop, so the commands are killed without their grace"
        assert keeper.fencing(), "and no claim until a heartbeat is saved again"
        keeper.heard(monotonic.now)
        assert not keeper.fencing()
        assert fence_after_s(HEARTBEAT_S) + HEARTBEAT_S <= gone_after_s(HEARTBEAT_S)
        tg.cancel_scope.cancel()


async def test_an_attempt_its_fence_stopped_goes_back_to_the_queue_without_using_an_attempt(
        store: SqliteStore, tmp_path: Path) -> None:
    """A node cut off from the fleet only briefly still holds its leases when the store answers again:
    the fenced attempt is written interrupted, and its task runs again at once, its attempt not counted."""
    monotonic = Clock(100.0)
    keeper = LeaseKeeper(store, lease_s=30.0, renew_every_s=10.0, flush_every_s=0.01,
                         fence_after_s=fence_after_s(HEARTBEAT_S), monotonic=monotonic)
    started = anyio.Event()

    async def sleepy(ctx: TaskContext) -> None:
        started.set()
        await anyio.sleep(30)

    registry = Registry({"sleepy": PluginDef("sleepy", sleepy)}, {"sleepy": TypeSettings(plugins=("sleepy",))})
    engine = Engine(store, registry, keeper, EventBus(), config=EngineConfig(stop_timeout_s=1.0),
                    policy=RetryPolicy(base_s=0.0, jitter=0.0), work_root=tmp_path)
    task, _ = await store.add(NewTask("sleepy", max_attempts=1), now=time.time())
    (claimed,) = await store.claim(Worker("a", "a-1", "a/w1"), ClaimFilter(), limit=1, now=time.time(), lease_s=30.0)
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        await tg.start(engine.outcomes.run)
        keeper.heard(monotonic.now)
        tg.start_soon(engine.run, claimed, "a/w1")
        await started.wait()
        monotonic.now += fence_after_s(HEARTBEAT_S)
        with anyio.fail_after(10):
            while (ended := await store.get(task.id)).state is not State.PENDING:
                await anyio.sleep(0.02)
        tg.cancel_scope.cancel()
    (attempt,) = ended.attempts
    assert attempt.status is AttemptStatus.INTERRUPTED
    assert (ended.attempt, ended.interruptions) == (0, 1), "its one attempt is still to be had"
