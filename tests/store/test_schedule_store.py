"""Schedules in the store: each tick creates exactly one task, however often and by whom it is fired."""

import asyncio
from functools import partial

import pytest

from tidepool.errors import ScheduleNotFound
from tidepool.model import State
from tidepool.schedules import Schedule, task_for
from tidepool.store import Store


def every(name: str = "s", seconds: float = 60.0, **kw: object) -> Schedule:
    return Schedule(name=name, type="noop", every_s=seconds, **kw)  # type: ignore[arg-type]


async def test_save_list_pause_resume_delete(store: Store) -> None:
    saved = await store.save_schedule(every(payload={"a": 1}), now=30.0)
    assert (saved.next_tick_at, saved.next_run_at) == (60.0, 60.0)
    assert [s.name for s in await store.list_schedules()] == ["s"]
    paused = await store.pause_schedule("s", paused=True, now=40.0)
    assert paused.paused
    assert await store.fire_schedules(now=1000.0) == []
    resumed = await store.pause_schedule("s", paused=False, now=1000.0)
    assert not resumed.paused and resumed.next_tick_at == 1020.0  # ticks missed while paused do not fire
    await store.delete_schedule("s")
    assert await store.list_schedules() == []
    with pytest.raises(ScheduleNotFound):
        await store.delete_schedule("s")
    with pytest.raises(ScheduleNotFound):
        await store.pause_schedule("s", paused=True, now=0.0)


async def test_saving_again_keeps_state_unless_the_timing_changed(store: Store) -> None:
    await store.save_schedule(every(), now=30.0)
    await store.fire_schedules(now=61.0)
    kept = await store.save_schedule(every(payload={"new": True}), now=70.0)
    assert kept.next_tick_at == 120.0 and kept.last_run_at == 60.0 and kept.payload == {"new": True}
    retimed = await store.save_schedule(every(seconds=300.0), now=70.0)
    assert retimed.next_tick_at == 300.0


async def test_which_config_defines_a_schedule_is_kept_and_an_api_save_takes_it_over(store: Store) -> None:
    await store.save_schedule(every(config_node="node-a"), now=30.0)
    await store.save_schedule(every("other"), now=30.0)
    assert {s.name: s.config_node for s in await store.list_schedules()} == {"s": "node-a", "other": None}
    await store.save_schedule(every(), now=40.0)  # saved again through the API: the file no longer owns it
    assert {s.name: s.config_node for s in await store.list_schedules()} == {"s": None, "other": None}


async def test_a_delete_fenced_on_the_defining_config_spares_a_schedule_taken_over_since(store: Store) -> None:
    await store.save_schedule(every("dropped", config_node="a"), now=30.0)
    await store.save_schedule(every("taken", config_node="a"), now=30.0)
    await store.save_schedule(every("taken"), now=31.0)  # an API save between node a's list and its delete
    await store.delete_schedule("dropped", config_node="a")
    for name, node in (("taken", "a"), ("taken", "b")):
        with pytest.raises(ScheduleNotFound):
            await store.delete_schedule(name, config_node=node)
    assert [s.name for s in await store.list_schedules()] == ["taken"]


async def test_a_due_tick_creates_one_task_and_advances(store: Store) -> None:
    await store.save_schedule(every(), now=30.0)
    fired = await store.fire_schedules(now=60.5)
    assert [(f.tick, f.reason) for f in fired] == [(60.0, None)]
    task = await store.get(fired[0].task_id or "")
    assert task.type == "noop" and task.idempotency_key == "schedule:s:1970-01-01T00:01:00+00:00"
    assert await store.fire_schedules(now=61.0) == []
    (schedule,) = await store.list_schedules()
    assert schedule.last_task_id == task.id and schedule.next_run_at == 120.0


async def test_a_tick_s_task_carries_the_tags_its_type_asks_for(store: Store) -> None:
    await store.save_schedule(every(), now=30.0)
    tagged = partial(task_for, required_tags=frozenset({"win10", "lic"}))  # what the node's type asks for
    (fired,) = await store.fire_schedules(now=60.5, new_task=tagged)
    assert (await store.get(fired.task_id or "")).required_tags == ("lic", "win10")


async def test_concurrent_firing_never_duplicates_a_tick(store: Store) -> None:
    await store.save_schedule(every(seconds=1.0), now=0.5)
    for second in range(1, 11):
        await asyncio.gather(*[store.fire_schedules(now=second + 0.1) for _ in range(3)])
    page = await store.list_tasks(limit=100)
    keys = [t.idempotency_key for t in page.tasks]
    assert len(keys) == 10 and len(set(keys)) == 10


@pytest.mark.parametrize(("catch_up", "tasks"), [("all", 5), ("last", 1), ("none", 0)])
async def test_downtime_catch_up(store: Store, catch_up: str, tasks: int) -> None:
    await store.save_schedule(every(catch_up=catch_up), now=30.0)
    fired = await store.fire_schedules(now=330.0)  # ticks 60..300 were missed
    assert len([f for f in fired if f.task_id]) == tasks
    assert len((await store.list_tasks(limit=100)).tasks) == tasks
    missed = [f for f in fired if f.reason == "missed"]
    assert sum(f.count for f in missed) == 5 - tasks


async def test_overlap_skip_waits_for_the_previous_task(store: Store) -> None:
    await store.save_schedule(every(overlap="skip"), now=30.0)
    (first,) = await store.fire_schedules(now=61.0)
    (skipped,) = await store.fire_schedules(now=121.0)
    assert skipped.reason == "overlap" and skipped.task_id is None
    assert (await store.request_cancel(first.task_id or "", now=122.0)).state is State.CANCELLED
    (second,) = await store.fire_schedules(now=181.0)
    assert second.task_id is not None and second.task_id != first.task_id


@pytest.mark.parametrize("kind", ["sqlite"])
async def test_an_op_that_breaks_fails_alone_not_its_whole_transaction(store: Store) -> None:
    from tidepool.errors import StoreUnavailable
    from tidepool.model import NewTask

    never = Schedule(name="feb30", type="noop", cron="0 0 30 2 *")  # slips past validate: raises in the op
    results = await asyncio.gather(store.save_schedule(never, now=0.0), store.add(NewTask("noop"), now=0.0),
                                   return_exceptions=True)
    assert isinstance(results[0], StoreUnavailable)
    task, created = results[1]  # type: ignore[misc]
    assert created and (await store.get(task.id)).state is State.PENDING


async def test_a_tick_that_would_fill_the_queue_past_max_queued_is_skipped_and_said(store: Store) -> None:
    """A schedule queues a task as a submit does: past pool.max_queued the tick is refused, not added."""
    from tidepool.model import NewTask

    await store.save_schedule(every(), now=30.0)
    await store.add(NewTask("noop"), now=30.0)
    (skipped,) = await store.fire_schedules(now=61.0, max_queued=1)
    assert (skipped.task_id, skipped.reason, skipped.tick) == (None, "queue_full", 60.0)
    assert len((await store.list_tasks()).tasks) == 1
    assert (await store.list_schedules())[0].next_tick_at == 120.0  # not tried again
    (fired,) = await store.fire_schedules(now=121.0, max_queued=2)
    assert fired.task_id is not None and fired.tick == 120.0


async def test_a_schedule_of_a_type_this_node_does_not_define_is_left_for_one_that_does(store: Store) -> None:
    """Its tasks would wait for ever on a node that cannot run them (a type taken out by a reload)."""
    await store.save_schedule(every(), now=30.0)
    assert await store.fire_schedules(now=61.0, defines=lambda s: s.type != "noop") == []
    assert (await store.list_tasks()).tasks == []
    assert (await store.list_schedules())[0].next_tick_at == 60.0, "untouched: another node fires it"
    (fired,) = await store.fire_schedules(now=61.0, defines=lambda s: s.type == "noop")
    assert fired.task_id is not None
