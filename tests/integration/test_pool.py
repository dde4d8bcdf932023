"""The pool grows under load up to max_workers, never above, and shrinks back after the idle timeout."""

import time
from pathlib import Path

import anyio
import pytest

from tidepool.execution.context import TaskContext
from tidepool.execution.pool import PoolConfig
from tidepool.execution.waker import Waker
from tidepool.model import State
from tidepool.store.sqlite import SqliteStore

from .conftest import running_node


async def test_pool_grows_from_2_to_8_under_a_burst_and_back_after_idle(sqlite_store: SqliteStore,
                                                                         tmp_path: Path) -> None:
    gate = anyio.Event()

    async def blocked(ctx: TaskContext) -> None:
        await gate.wait()

    config = PoolConfig(min_workers=2, max_workers=8, idle_timeout_s=0.3, poll_interval_s=0.5)
    async with running_node(sqlite_store, {"blocked": blocked}, pool=config, work_root=tmp_path) as node:
        assert node.pool.statistics().workers == 2
        ids = await node.submit_many("blocked", 20)
        await node.until(lambda: node.pool.statistics().busy == 8)
        stats = node.pool.statistics()
        assert (stats.workers, stats.baseline, stats.demand) == (8, 2, 6)
        gate.set()
        for task_id in ids:
            assert (await node.finished(task_id)).state is State.COMPLETED
        await node.until(lambda: node.pool.statistics().workers == 2)
        started = [e for e in node.seen if e.name == "worker.started"]
        stopped = [e for e in node.seen if e.name == "worker.stopped"]
        assert len(started) == 8  # never above max_workers
        assert [(e.data["kind"], e.data["reason"]) for e in started] == [("baseline", "start")] * 2 + \
            [("demand", "busy")] * 6
        assert [e.data["reason"] for e in stopped] == ["idle"] * 6
        assert all(e.data["kind"] == "demand" for e in stopped)


async def test_a_demand_worker_starts_when_every_worker_is_busy(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    gate = anyio.Event()

    async def blocked(ctx: TaskContext) -> None:
        await gate.wait()

    config = PoolConfig(min_workers=1, max_workers=3, idle_timeout_s=5.0, poll_interval_s=0.5)
    async with running_node(sqlite_store, {"blocked": blocked}, pool=config, work_root=tmp_path) as node:
        await node.submit("blocked")
        await node.until(lambda: node.pool.statistics().busy == 1)
        # the claim saturated the only worker: a demand worker is already there, idle, waiting
        assert node.pool.statistics().workers == 2
        gate.set()


async def test_resize_live_grows_and_retires_without_touching_running_tasks(sqlite_store: SqliteStore,
                                                                            tmp_path: Path) -> None:
    gate = anyio.Event()

    async def blocked(ctx: TaskContext) -> None:
        await gate.wait()

    config = PoolConfig(min_workers=2, max_workers=4, idle_timeout_s=30.0, poll_interval_s=0.5)
    async with running_node(sqlite_store, {"blocked": blocked}, pool=config, work_root=tmp_path) as node:
        running = await node.submit("blocked")
        await node.until(lambda: node.pool.statistics().busy == 1)
        node.pool.resize(min_workers=5, max_workers=6)
        await node.until(lambda: node.pool.statistics().workers == 5)
        node.pool.resize(min_workers=1, max_workers=1)
        await node.until(lambda: node.pool.statistics().workers == 1)
        assert not node.pool.resize(min_workers=1, idle_timeout_s=30.0) and not node.pool.resize()  # no change
        resized = [(e.data["min_workers"], e.data["max_workers"]) for e in node.seen if e.name == "pool.resized"]
        assert resized == [(5, 6), (1, 1)], "a resize that changes nothing announces nothing"
        with anyio.fail_after(5):  # the phase is written behind; it lands within a flush
            while (await node.store.get(running)).state is not State.RUNNING:
                await anyio.sleep(0.01)
        gate.set()
        assert (await node.finished(running)).state is State.COMPLETED


async def test_waker_keeps_a_wake_that_came_before_the_wait() -> None:
    waker = Waker()
    waker.wake(1)
    with anyio.fail_after(1):
        await waker.wait(timeout_s=30)  # returns at once: the permit was kept


async def test_work_that_arrives_while_every_worker_is_mid_claim_is_started_at_once(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    """Each worker's claim looked at the queue before the tasks went in, so each comes back empty: the wakes
    that came meanwhile must send every one of them to claim again, not one (the rest used to sleep a whole
    poll interval: seen on PostgreSQL, whose claims run beside the insert)."""
    looked, answer = anyio.Event(), anyio.Event()
    in_claim = 0

    class LateAnswers:  # the real store; its claims only hold their (empty) answer back while the test adds
        def __getattr__(self, name: str) -> object:
            return getattr(sqlite_store, name)

        async def claim(self, *args: object, **kwargs: object) -> object:
            nonlocal in_claim
            claimed = await sqlite_store.claim(*args, **kwargs)  # type: ignore[arg-type]
            in_claim += 1
            if in_claim == 4:
                looked.set()
            await answer.wait()
            return claimed

    gate = anyio.Event()

    async def blocked(ctx: TaskContext) -> None:
        await gate.wait()

    # a missed wake costs 30 s; claim_batch 1: each worker claims for itself, so four claims are out at once
    config = PoolConfig(min_workers=4, max_workers=4, poll_interval_s=30.0, claim_batch=1)
    async with running_node(LateAnswers(), {"blocked": blocked}, pool=config,  # type: ignore[arg-type]
                            work_root=tmp_path) as node:
        with anyio.fail_after(5):
            await looked.wait()
        await node.submit_many("blocked", 4)  # adds and wakes 4 while all 4 claims are out
        answer.set()
        with anyio.fail_after(5):
            await node.until(lambda: node.pool.statistics().busy == 4)
        gate.set()


async def test_idle_pool_sleeps_instead_of_polling(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    claims = 0
    original = sqlite_store.claim

    async def counting_claim(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal claims
        claims += 1
        return await original(*args, **kwargs)

    sqlite_store.claim = counting_claim  # type: ignore[method-assign]
    config = PoolConfig(min_workers=4, max_workers=4, poll_interval_s=1.0)
    async with running_node(sqlite_store, {}, pool=config, work_root=tmp_path):
        await anyio.sleep(0.5)
    assert claims <= 4  # one look each at start, then asleep until woken or the 1 s poll


async def test_raising_min_at_max_keeps_the_demand_workers_as_baseline(sqlite_store: SqliteStore,
                                                                       tmp_path: Path) -> None:
    gate = anyio.Event()

    async def blocked(ctx: TaskContext) -> None:
        await gate.wait()

    config = PoolConfig(min_workers=2, max_workers=4, idle_timeout_s=0.2, poll_interval_s=0.5)
    async with running_node(sqlite_store, {"blocked": blocked}, pool=config, work_root=tmp_path) as node:
        await node.submit_many("blocked", 4)
        await node.until(lambda: node.pool.statistics().busy == 4)
        node.pool.resize(min_workers=4)  # already at max: the demand workers become baseline
        gate.set()
        await anyio.sleep(0.6)  # three idle timeouts: a demand worker would have retired by now
        stats = node.pool.statistics()
        assert (stats.workers, stats.baseline, stats.demand) == (4, 4, 0)


async def test_a_plugin_that_holds_the_event_loop_up_is_named_in_a_warning(sqlite_store: SqliteStore,
                                                                            tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Nothing else can say why leases went unrenewed and the API did not answer for seconds."""
    async def blocks(ctx: TaskContext) -> None:
        time.sleep(2.6)  # the plugin author's mistake: blocking code in a coroutine

    with caplog.at_level("WARNING", logger="tidepool.pool"):
        async with running_node(sqlite_store, {"blocks": blocks}, work_root=tmp_path) as node:
            task = await node.finished(await node.submit("blocks"))
            await anyio.sleep(0.6)  # the supervisor's next tick
    (said,) = [r.getMessage() for r in caplog.records if "held up" in r.getMessage()]
    assert f"plugin blocks: 1 tasks ({task.id})" in said, said
