"""Tick arithmetic of schedules: on time, across DST, catch-up after downtime, no bursts."""

import itertools
import json
from dataclasses import replace
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from tidepool.errors import InvalidRequest
from tidepool.model import NewTask
from tidepool.schedules import (
    MAX_CATCH_UP,
    Schedule,
    fire,
    jitter_of,
    next_tick,
    plan,
    spec_of,
    start,
    stored_spec,
    validate,
)

BERLIN = ZoneInfo("Europe/Berlin")


def at(*args: int, tz: ZoneInfo = BERLIN) -> float:
    return datetime(*args, tzinfo=tz).timestamp()  # type: ignore[misc]


def every(seconds: float, **kw: object) -> Schedule:
    return Schedule(name="s", type="noop", every_s=seconds, **kw)  # type: ignore[arg-type]


def test_every_second_fires_each_tick_on_time() -> None:
    schedule = start(every(1.0), 1000.2)
    assert schedule.next_run_at == 1001.0
    fired_at = []
    now = 1000.2
    while now < 1010:  # an injected clock stepping 100 ms, as the scheduler loop would
        now = round(now + 0.1, 1)
        if schedule.next_run_at is not None and schedule.next_run_at <= now:
            firing = plan(schedule, now)
            fired_at += firing.fire
            schedule = replace(schedule, next_tick_at=firing.next_tick_at, next_run_at=firing.next_run_at)
    assert fired_at == [float(t) for t in range(1001, 1011)]


def test_cron_skips_the_missing_hour_of_spring_forward() -> None:
    schedule = Schedule(name="n", type="noop", cron="30 2 * * *", timezone="Europe/Berlin")
    ticks, t = [], at(2026, 3, 27, 12, 0)
    for _ in range(3):
        t = next_tick(schedule, t)
        ticks.append(datetime.fromtimestamp(t, BERLIN).isoformat())
    # 02:30 does not exist on 29 March: the run happens once, at 03:00 CEST, not twice and not skipped
    assert ticks == ["2026-03-28T02:30:00+01:00", "2026-03-29T03:00:00+02:00", "2026-03-30T02:30:00+02:00"]


def test_cron_fires_once_per_day_across_fall_back() -> None:
    schedule = Schedule(name="n", type="noop", cron="30 1 * * *", timezone="Europe/Berlin")
    t = at(2026, 10, 24, 12, 0)
    first, second = next_tick(schedule, t), next_tick(schedule, next_tick(schedule, t))
    assert datetime.fromtimestamp(first, BERLIN).isoformat() == "2026-10-25T01:30:00+02:00"
    assert second - first == 25 * 3600  # the day of the change has 25 hours


def test_hourly_cron_runs_both_repeated_hours_of_fall_back() -> None:
    schedule = Schedule(name="h", type="noop", cron="0 * * * *", timezone="Europe/Berlin")
    t = at(2026, 10, 25, 0, 30)
    ticks = []
    for _ in range(4):
        t = next_tick(schedule, t)
        ticks.append(t)
    assert [b - a for a, b in itertools.pairwise(ticks)] == [3600.0] * 3  # evenly spaced in real time


@pytest.mark.parametrize(("catch_up", "fired"), [("all", 5), ("last", 1), ("none", 0)])
def test_catch_up_after_downtime(catch_up: str, fired: int) -> None:
    schedule = replace(start(every(60.0, catch_up=catch_up), 0.0), next_tick_at=60.0, next_run_at=60.0)
    firing = plan(schedule, 5 * 60 + 30.0)  # down for five ticks
    assert len(firing.fire) == fired
    assert len(firing.fire) + len(firing.skipped) == 5
    assert firing.next_tick_at == 360.0
    if catch_up == "last":
        assert firing.fire == [300.0]


def test_catch_up_all_is_bounded_and_a_clock_jump_never_bursts() -> None:
    schedule = replace(start(every(1.0, catch_up="all"), 0.0), next_tick_at=1.0, next_run_at=1.0)
    firing = plan(schedule, 86_400.0)  # the clock jumped a day ahead
    assert len(firing.fire) == MAX_CATCH_UP


def test_catch_up_none_still_fires_a_tick_that_is_on_time() -> None:
    schedule = start(every(60.0, catch_up="none"), 0.0)
    assert plan(schedule, 60.5).fire == [60.0]


def test_clock_going_back_restarts_from_now_without_firing() -> None:
    schedule = start(every(60.0), 10_000.0)
    fired, saved = fire(schedule, 100.0, max_attempts=lambda _: 3, running=lambda _: False, add=lambda _: "t")
    assert fired == []
    assert saved.next_tick_at == 120.0


def test_overlap_skip_skips_while_the_previous_task_runs() -> None:
    schedule = replace(start(every(60.0, overlap="skip"), 0.0), last_task_id="busy")
    added: list[NewTask] = []
    fired, saved = fire(schedule, 61.0, max_attempts=lambda _: 3, running=lambda task_id: task_id == "busy",
                        add=lambda new: added.append(new) or "t2")
    assert added == [] and fired[0].reason == "overlap" and saved.last_task_id == "busy"
    fired, saved = fire(saved, 121.0, max_attempts=lambda _: 3, running=lambda _: False, add=lambda new: "t3")
    assert fired[0].task_id == "t3" and saved.last_task_id == "t3"


def test_a_tick_fires_one_task_with_its_idempotency_key_and_its_type_s_attempt_budget() -> None:
    schedule = start(every(60.0), 0.0)
    added: list[NewTask] = []
    budgets = {schedule.type: 1}
    fire(schedule, 60.0, max_attempts=budgets.__getitem__, running=lambda _: False,
         add=lambda new: added.append(new) or "t")
    assert [(n.idempotency_key, n.max_attempts) for n in added] == [("schedule:s:1970-01-01T00:01:00+00:00", 1)]


def test_jitter_is_the_same_on_every_node_and_within_bounds() -> None:
    schedule = every(60.0, jitter_s=10.0)
    offsets = {jitter_of(schedule, t) for t in (60.0, 120.0, 180.0)}
    assert all(0 <= o < 10 for o in offsets) and len(offsets) == 3
    assert jitter_of(schedule, 60.0) == jitter_of(replace(schedule), 60.0)


@pytest.mark.parametrize(("schedule", "field"), [
    (Schedule(name="x", type="noop"), "cron"),
    (Schedule(name="x", type="noop", cron="* *", every_s=None), "cron"),
    (Schedule(name="x", type="noop", cron="0 * * * *", every_s=5.0), "cron"),
    (Schedule(name="x", type="noop", every_s=5.0, timezone="Mars/Olympus"), "timezone"),
])
def test_invalid_schedules_name_the_field(schedule: Schedule, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate(schedule)
    assert info.value.field == field


def test_a_payload_that_is_not_json_is_refused() -> None:
    import datetime as dt

    with pytest.raises(InvalidRequest) as info:
        validate(Schedule(name="x", type="noop", every_s=60.0, payload={"when": dt.date(2026, 1, 1)}))
    assert info.value.field == "payload"


def test_sub_second_periods_are_refused() -> None:
    with pytest.raises(InvalidRequest) as info:
        validate(Schedule(name="x", type="noop", every_s=3e-308))
    assert info.value.field == "every_s"


def test_a_cron_that_never_fires_is_refused() -> None:
    with pytest.raises(InvalidRequest) as info:
        validate(Schedule(name="x", type="noop", cron="0 0 30 2 *"))  # 30 February
    assert info.value.field == "cron"


@pytest.mark.parametrize("cron", [
    "* * * * * *",  # croniter reads a sixth field as seconds: every second, below the floor of every_s
    "0 2 * *",
])
def test_a_cron_without_exactly_five_fields_is_refused(cron: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate(Schedule(name="x", type="noop", cron=cron))
    assert info.value.field == "cron"


def test_a_five_field_cron_or_an_alias_is_accepted() -> None:
    schedule = validate(Schedule(name="x", type="noop", cron="*/15 * * * *"))
    assert next_tick(schedule, at(2026, 1, 1, 0, 7)) == at(2026, 1, 1, 0, 15)
    hourly = validate(Schedule(name="x", type="noop", cron="@hourly"))
    assert next_tick(hourly, at(2026, 1, 1, 0, 7)) == at(2026, 1, 1, 1, 0)


def test_a_stored_spec_with_a_field_of_a_newer_version_still_reads() -> None:
    """Nodes of two versions share a store while a fleet is upgraded."""
    spec = spec_of(Schedule(name="x", type="noop", every_s=60.0))
    assert stored_spec(json.dumps({**spec, "added_later": True})) == spec
