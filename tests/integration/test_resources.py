"""Resource slots: tasks that need tags get a matching slot in prepare, wait for one fairly, and always give it back."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import ClassVar

import anyio
import anyio.lowlevel
import pytest

from tidepool.errors import ConfigError, InvalidRequest, PluginError
from tidepool.execution.context import TaskContext
from tidepool.execution.engine import EngineConfig
from tidepool.execution.pool import PoolConfig
from tidepool.execution.resources import ResourcePool, Slot
from tidepool.model import AttemptStatus, NewTask, State
from tidepool.node.daemon import Daemon
from tidepool.settings import ResourceSettings, TypeSettings, parse
from tidepool.store.sqlite import SqliteStore

from .conftest import running_node


def slots(**resources: ResourceSettings) -> ResourcePool:
    return ResourcePool.from_settings(resources)


class Recorder:
    """Machinery loaded by dotted path in these tests; records what it was asked to do."""

    calls: ClassVar[list[str]] = []
    fail_start: ClassVar[bool] = False
    hang_start: ClassVar[bool] = False
    hang_stop: ClassVar[bool] = False

    async def start(self, slot: Slot) -> None:
        self.calls.append(f"start {slot}")
        if self.fail_start:
            raise RuntimeError("snapshot revert failed")
        if self.hang_start:
            await anyio.sleep_forever()

    async def stop(self, slot: Slot) -> None:
        self.calls.append(f"stop {slot}")
        if self.hang_stop:
            await anyio.sleep_forever()


@pytest.fixture
def recorder() -> type[Recorder]:
    Recorder.calls.clear()
    Recorder.fail_start = Recorder.hang_start = Recorder.hang_stop = False
    return Recorder


# the slot pool on its own


async def test_waiters_are_served_in_arrival_order_and_a_slot_is_handed_over_directly() -> None:
    pool = slots(vm=ResourceSettings(tags=("win10", "x64"), count=1))
    first = await pool.acquire(["win10"], timeout_s=1)
    assert pool.free_tag_sets() == ()
    order: list[str] = []

    async def wait(name: str) -> None:
        slot = await pool.acquire(["x64"] if name == "b" else ["win10"], timeout_s=5)
        order.append(name)
        await anyio.sleep(0.01)
        pool.release(slot)

    async with anyio.create_task_group() as tg:
        for name in "abc":
            tg.start_soon(wait, name)
            with anyio.fail_after(1):
                while pool.statistics().waiting < "abc".index(name) + 1:
                    await anyio.sleep(0.001)
        pool.release(first)
    assert order == ["a", "b", "c"]
    assert pool.statistics().resources["vm"].in_use == 0
    assert pool.free_tag_sets() == (frozenset({"win10", "x64"}),)


async def test_a_claim_in_flight_is_promised_a_slot_of_each_tag_set_it_asks_for() -> None:
    pool = slots(vm=ResourceSettings(tags=("win10",), count=2), nic=ResourceSettings(tags=("nic",), count=1))
    vm, nic = frozenset({"win10"}), frozenset({"nic"})
    assert set(pool.free_tag_sets()) == {vm, nic}
    with pool.claiming((vm, nic)):
        assert pool.free_tag_sets() == (vm,)  # the second vm slot is still free; the only nic slot is not
        with pool.claiming(pool.free_tag_sets()):
            assert pool.free_tag_sets() == ()
    assert set(pool.free_tag_sets()) == {vm, nic}


async def test_a_promised_slot_is_not_taken_by_a_task_whose_tags_it_also_covers() -> None:
    pool = slots(big=ResourceSettings(tags=("a", "b"), count=1), small=ResourceSettings(tags=("a",), count=2))
    with pool.claiming(pool.free_tag_sets()):  # claim A asks for both kinds: one big and one small promised
        other = await pool.acquire(["a"], timeout_s=1)  # claim B's task: a small slot, not the promised big one
        assert other.name == "small"
    mine = await pool.acquire(["a", "b"], timeout_s=1)  # claim A's task, as its promise ends
    assert mine.name == "big"


async def test_a_claim_held_back_by_a_promise_that_went_unused_is_made_again() -> None:
    woken: list[str] = []
    pool = ResourcePool.from_settings({"vm": ResourceSettings(tags=("win10",), count=1)},
                                      on_free=lambda: woken.append("wake"))
    with pool.claiming(pool.free_tag_sets()):  # claim A: the only slot promised
        assert pool.free_tag_sets() == ()  # claim B asks without it, and may miss a task for it
    await anyio.lowlevel.checkpoint()  # A's worker took nothing: the slot is still free
    assert woken == ["wake"]
    with pool.claiming(pool.free_tag_sets()):  # no claim held back this time: no wake
        pass
    await anyio.lowlevel.checkpoint()
    assert woken == ["wake"]


async def test_tags_no_slot_can_ever_serve_fail_at_once_not_retried() -> None:
    pool = slots(vm=ResourceSettings(tags=("win10",), count=2))
    with anyio.fail_after(0.5), pytest.raises(PluginError) as caught:
        await pool.acquire(["win10", "gpu"], timeout_s=60)
    assert (caught.value.code, caught.value.retryable) == ("unserviceable", False)
    assert "gpu" in str(caught.value)


async def test_waiting_past_the_timeout_is_a_retryable_prepare_timeout() -> None:
    pool = slots(lic=ResourceSettings(tags=("licence",), count=1))
    held = await pool.acquire(["licence"], timeout_s=1)
    with pytest.raises(PluginError) as caught:
        await pool.acquire(["licence"], timeout_s=0.05)
    assert (caught.value.code, caught.value.retryable) == ("prepare_timeout", True)
    assert pool.statistics().waiting == 0  # the timed-out waiter is gone: a release goes to the free list
    pool.release(held)
    pool.release(held)  # releasing twice is harmless
    assert pool.statistics().resources["lic"].in_use == 0


async def test_a_cancelled_waiter_leaves_nothing_behind() -> None:
    pool = slots(lic=ResourceSettings(tags=("licence",), count=1))
    held = await pool.acquire([], timeout_s=1)  # no tags: any slot
    with anyio.move_on_after(0.05):
        await pool.acquire(["licence"], timeout_s=60)
    assert pool.statistics().waiting == 0
    pool.release(held)
    assert await pool.acquire(["licence"], timeout_s=0.1) == held


async def test_machinery_starts_after_acquire_and_stops_before_release(recorder: type[Recorder]) -> None:
    path = f"{__name__}:Recorder"
    pool = slots(vm=ResourceSettings(tags=("win10",), count=2, plugin=path))
    slot = await pool.acquire(["win10"], timeout_s=1)
    await pool.stop(slot)
    pool.release(slot)
    assert recorder.calls == ["start vm[0]", "stop vm[0]"]

    recorder.fail_start = True
    with pytest.raises(PluginError) as caught:
        await pool.acquire(["win10"], timeout_s=1)
    assert caught.value.code == "resource_start_failed" and "snapshot revert failed" in str(caught.value)
    assert pool.statistics().resources["vm"].in_use == 0  # a failed start gives the slot back



async def test_a_start_hook_that_overruns_the_timeout_is_named_and_its_slot_goes_back(recorder: type[Recorder]) -> None:
    recorder.hang_start = True
    pool = slots(vm=ResourceSettings(tags=("win10",), count=1, plugin=f"{__name__}:Recorder"))
    with pytest.raises(PluginError) as caught:
        await pool.acquire(["win10"], timeout_s=0.05)
    assert caught.value.code == "prepare_timeout"
    assert str(caught.value) == "resource vm[0]: machinery start hook did not finish within 0.05s", \
        "before: 'no slot became free', while the slot was free and its start hook hung"
    assert pool.statistics().resources["vm"].in_use == 0

def test_machinery_that_cannot_load_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"resources\.vm\.plugin"):
        slots(vm=ResourceSettings(tags=("x",), plugin="no_such_module_for_tidepool:Thing"))
    with pytest.raises(ConfigError, match="start"):
        slots(vm=ResourceSettings(tags=("x",), plugin="json"))  # a module without the hooks


# through the engine


async def test_two_tasks_needing_a_count_1_resource_never_overlap(sqlite_store: SqliteStore, tmp_path: Path,
                                                                   recorder: type[Recorder]) -> None:
    intervals: list[tuple[float, float, str]] = []

    async def uses_licence(ctx: TaskContext) -> None:
        entered = time.monotonic()
        assert ctx.resource is not None
        await anyio.sleep(0.15)
        intervals.append((entered, time.monotonic(), str(ctx.resource)))

    pool = slots(lic=ResourceSettings(tags=("licence",), count=1, plugin=f"{__name__}:Recorder"))
    config = PoolConfig(min_workers=3, max_workers=3, poll_interval_s=0.5)
    async with running_node(sqlite_store, {"scan": uses_licence}, pool=config, resources=pool,
                            work_root=tmp_path) as node:
        ids = [await node.submit("scan", required_tags=("licence",)) for _ in range(3)]
        tasks = [await node.finished(task_id) for task_id in ids]
    assert [t.state for t in tasks] == [State.COMPLETED] * 3
    intervals.sort()
    assert all(a_exit <= b_enter for (_, a_exit, _), (b_enter, _, _) in itertools.pairwise(intervals))
    assert {slot for *_, slot in intervals} == {"lic[0]"}
    assert recorder.calls == ["start lic[0]", "stop lic[0]"] * 3
    assert pool.statistics().resources["lic"].in_use == 0


async def test_a_freed_slot_is_claimed_once_not_by_every_idle_worker_at_the_same_moment(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    """A claim asks only for tags a free slot can serve. Two workers claiming together used to both
    take a task for the one slot that had just come free: the second waited in prepare, holding a worker,
    and failed prepare_timeout, an attempt spent for nothing."""
    async def busy(ctx: TaskContext) -> None:
        await anyio.sleep(0.4)

    pool = slots(vm=ResourceSettings(tags=("win10",), count=1))
    config = PoolConfig(min_workers=4, max_workers=4, poll_interval_s=0.5)
    async with running_node(sqlite_store, {"busy": busy}, pool=config, resources=pool, work_root=tmp_path,
                            engine_config=EngineConfig(prepare_timeout_s=0.3, stop_timeout_s=2.0)) as node:
        ids = [await node.submit("busy", required_tags=("win10",), max_attempts=1) for _ in range(4)]
        tasks = [await node.finished(task_id, timeout_s=10) for task_id in ids]
    assert [(t.state, t.error) for t in tasks] == [(State.COMPLETED, None)] * 4


async def test_a_stop_hook_that_overruns_stop_timeout_is_said_with_the_task_and_its_slot_freed(
        sqlite_store: SqliteStore, tmp_path: Path, recorder: type[Recorder], caplog: pytest.LogCaptureFixture) -> None:
    """A VM left running or unreverted: the next task gets that slot, so the operator must hear of it."""
    async def uses_vm(ctx: TaskContext) -> None:
        pass

    recorder.hang_stop = True
    pool = slots(vm=ResourceSettings(tags=("win10",), count=1, plugin=f"{__name__}:Recorder"))
    async with running_node(sqlite_store, {"scan": uses_vm}, resources=pool, work_root=tmp_path,
                            engine_config=EngineConfig(stop_timeout_s=0.2)) as node:
        task = await node.finished(await node.submit("scan", required_tags=("win10",)))
    assert task.state is State.COMPLETED and pool.statistics().resources["vm"].in_use == 0
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "stop phase" in r.getMessage()]
    assert len(said) == 1 and task.id in said[0] and "vm[0]" in said[0] and "stop_timeout_s" in said[0], said


async def test_a_task_needing_no_tags_takes_no_slot(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    seen: list[object] = []

    async def plain(ctx: TaskContext) -> None:
        seen.append(ctx.resource)

    pool = slots(lic=ResourceSettings(tags=("licence",), count=1))
    async with running_node(sqlite_store, {"plain": plain}, resources=pool, work_root=tmp_path) as node:
        assert (await node.finished(await node.submit("plain"))).state is State.COMPLETED
    assert seen == [None]


async def test_tags_of_the_type_no_resource_has_fail_the_task_at_once(sqlite_store: SqliteStore,
                                                                      tmp_path: Path) -> None:
    ran = False

    async def gpu_job(ctx: TaskContext) -> None:
        nonlocal ran
        ran = True

    pool = slots(lic=ResourceSettings(tags=("licence",), count=1))
    types = {"gpu": TypeSettings(plugins=("gpu_job",), required_tags=("gpu",))}
    async with running_node(sqlite_store, {"gpu_job": gpu_job}, types=types, resources=pool,
                            work_root=tmp_path) as node:
        task = await node.finished(await node.submit("gpu", max_attempts=3), timeout_s=2)
    assert task.state is State.FAILED
    assert task.error is not None and task.error.code == "unserviceable"
    assert [a.status for a in task.attempts] == [AttemptStatus.FAILED]  # not retried
    assert not ran


async def test_a_task_waits_for_a_busy_slot_and_is_woken_when_it_frees(sqlite_store: SqliteStore,
                                                                       tmp_path: Path) -> None:
    gate = anyio.Event()

    async def hold(ctx: TaskContext) -> None:
        await gate.wait()

    pool = slots(nic=ResourceSettings(tags=("nic",), count=1))
    # A slow poll: only the release's wake-up can get the second task claimed in time.
    config = PoolConfig(min_workers=2, max_workers=2, poll_interval_s=60.0)
    async with running_node(sqlite_store, {"hold": hold}, pool=config, resources=pool,
                            work_root=tmp_path) as node:
        first = await node.submit("hold", required_tags=("nic",))
        await node.until(lambda: "plugin.started" in node.names(first))
        second = await node.submit("hold", required_tags=("nic",))
        await anyio.sleep(0.2)
        assert (await node.store.get(second)).state is State.PENDING  # no free slot: not claimed
        gate.set()
        assert (await node.finished(first, timeout_s=5)).state is State.COMPLETED
        assert (await node.finished(second, timeout_s=5)).state is State.COMPLETED


# the daemon's wiring


def test_submit_refuses_tags_no_resource_has_and_adds_the_types_tags(tmp_path: Path) -> None:
    settings = parse({
        "node": {"id": "t", "state_dir": str(tmp_path)}, "store": {"url": f"sqlite:///{tmp_path}/t.db"},
        "resources": {"vm": {"tags": ["win10", "x64"], "count": 2}},
        "types": {"winscan": {"plugins": ["noop"], "required_tags": ["win10"]},
                  "gpuscan": {"plugins": ["noop"], "required_tags": ["gpu"]}},
    })
    daemon = Daemon(settings)
    with pytest.raises(InvalidRequest) as caught:
        daemon.ops.check(NewTask("noop", required_tags=("linux",)))
    assert caught.value.field == "required_tags"
    with pytest.raises(InvalidRequest):
        daemon.ops.check(NewTask("gpuscan"))
    assert daemon.ops.check(NewTask("winscan", required_tags=("x64",))).required_tags == ("win10", "x64")
    assert daemon.ops.check(NewTask("noop")).required_tags == ()
    # the claim filter offers the tags of the free slots
    assert daemon.claims.filter().tag_sets == (frozenset({"win10", "x64"}),)


async def test_the_claim_filter_follows_the_free_slots(tmp_path: Path) -> None:
    settings = parse({"node": {"id": "t", "state_dir": str(tmp_path)},
                      "store": {"url": f"sqlite:///{tmp_path}/t.db"},
                      "resources": {"vm": {"tags": ["win10"], "count": 1}, "nic": {"tags": ["nic"]}}})
    daemon = Daemon(settings)
    assert set(daemon.claims.filter().tag_sets) == {frozenset({"win10"}), frozenset({"nic"})}
    slot = await daemon.resources.acquire(["win10"], timeout_s=1)
    assert daemon.claims.filter().tag_sets == (frozenset({"nic"}),)
    daemon.resources.release(slot)
    assert set(daemon.claims.filter().tag_sets) == {frozenset({"win10"}), frozenset({"nic"})}
