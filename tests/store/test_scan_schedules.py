"""A profile schedule in the store: each tick starts exactly one scan, with its first task, as the tick fires."""

from tidepool.errors import InvalidRequest
from tidepool.model import NewTask, State
from tidepool.scans import NewScan, ScanState, StepSpec
from tidepool.schedules import Schedule, tick_key
from tidepool.store import Store

STEPS = (StepSpec("noop", 2), StepSpec("noop", 2))


def scan_for(schedule: Schedule, tick: float) -> NewScan:
    """A tick's scan as the node makes one: its profile's steps, the schedule's payload, the tick's key."""
    assert schedule.profile is not None
    return NewScan(schedule.profile, STEPS, dict(schedule.payload), schedule.priority,
                   idempotency_key=tick_key(schedule, tick))


def weekly(**kw: object) -> Schedule:
    return Schedule(name="w", profile="discover", payload={"target": "x"}, every_s=60.0, **kw)  # type: ignore[arg-type]


async def test_a_profile_schedule_starts_one_scan_per_tick_with_its_first_task(store: Store) -> None:
    await store.save_schedule(weekly(priority=3), now=30.0)
    (fired,) = await store.fire_schedules(now=61.0, new_task=scan_for)
    assert fired.task_id is None and fired.scan_id is not None and fired.reason is None
    scan = await store.get_scan(fired.scan_id)
    assert (scan.profile, scan.state, scan.payload) == ("discover", ScanState.PENDING, {"target": "x"})
    first = await store.get(scan.jobs[0].task_id or "")
    assert (first.type, first.priority, first.state) == ("noop", 3, State.PENDING)
    (saved,) = await store.list_schedules()
    assert (saved.profile, saved.type, saved.last_task_id, saved.last_run_at) == ("discover", None, scan.id, 60.0)
    assert await store.fire_schedules(now=62.0, new_task=scan_for) == [], "a tick fires once"
    assert len((await store.list_scans()).scans) == 1


async def test_a_tick_whose_scan_exists_already_starts_none(store: Store) -> None:
    await store.save_schedule(weekly(), now=30.0)
    (schedule,) = await store.list_schedules()
    existing, _ = await store.add_scan(scan_for(schedule, 60.0), now=50.0)  # another node fired it: same key
    fired = await store.fire_schedules(now=61.0, new_task=scan_for)
    assert [f.scan_id for f in fired] == []
    assert [s.id for s in (await store.list_scans()).scans] == [existing.id]


async def test_overlap_skip_waits_for_the_last_scan_to_end_not_its_first_task(store: Store) -> None:
    await store.save_schedule(weekly(overlap="skip"), now=30.0)
    (first,) = await store.fire_schedules(now=61.0, new_task=scan_for)
    (skipped,) = await store.fire_schedules(now=121.0, new_task=scan_for)
    assert (skipped.scan_id, skipped.reason) == (None, "overlap")
    assert first.scan_id is not None
    await store.cancel_scan(first.scan_id, now=122.0)  # its queued task ends at once, and the scan with it
    assert (await store.get_scan(first.scan_id)).state is ScanState.CANCELLED
    (again,) = await store.fire_schedules(now=181.0, new_task=scan_for)
    assert again.scan_id not in (None, first.scan_id)


async def test_a_tick_past_max_queued_is_skipped_and_starts_nothing(store: Store) -> None:
    await store.add(NewTask("noop", {}, 0, 3, None, (), None, None), now=1.0)
    await store.save_schedule(weekly(), now=30.0)
    (fired,) = await store.fire_schedules(now=61.0, new_task=scan_for, max_queued=1)
    assert (fired.scan_id, fired.reason) == (None, "queue_full")
    assert (await store.list_scans()).scans == []


async def test_a_node_that_does_not_define_the_profile_leaves_the_schedule_alone(store: Store) -> None:
    await store.save_schedule(weekly(), now=30.0)
    assert await store.fire_schedules(now=61.0, new_task=scan_for, defines=lambda s: s.profile != "discover") == []
    (kept,) = await store.list_schedules()
    assert kept.next_run_at == 60.0 and (await store.list_scans()).scans == []



async def test_a_tick_whose_scan_is_refused_is_skipped_and_the_schedule_goes_on(store: Store) -> None:
    def refused(schedule: Schedule, tick: float) -> NewScan:
        raise InvalidRequest("payload.target", "missing: the first step's command needs it")

    await store.save_schedule(weekly(), now=30.0)
    (fired,) = await store.fire_schedules(now=61.0, new_task=refused)
    assert (fired.scan_id, fired.reason) == (None, "refused")
    (kept,) = await store.list_schedules()
    assert kept.next_tick_at == 120.0 and (await store.list_scans()).scans == []
