"""Tick arithmetic of schedules: on time, across DST, catch-up after downtime, no bursts."""

import itertools
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from tidepool.errors import InvalidRequest
from tidepool.model import NewTask
from tidepool.schedules import (
    MAX_CATCH_UP,
    MAX_COUNTED,
    Fired,
    Schedule,
    fire,
    jitter_of,
    next_tick,
    plan,
    spec_of,
    start,
    stored_spec,
    task_for,
    tick_key,
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


@pytest.mark.parametrize(("year", "day"), [(2026, 29), (2027, 28)])
def test_cron_skips_the_missing_hour_of_spring_forward(year: int, day: int) -> None:
    schedule = Schedule(name="n", type="noop", cron="30 2 * * *", timezone="Europe/Berlin")
    # 02:30 does not exist on the day of the change: the run happens once, at 03:00 CEST, not twice and not skipped
    assert ticks(schedule, at(year, 3, day - 2, 12, 0), 3) == [
        f"{year}-03-{day - 1}T02:30:00+01:00", f"{year}-03-{day}T03:00:00+02:00", f"{year}-03-{day + 1}T02:30:00+02:00"]


def ticks(schedule: Schedule, after: float, count: int) -> list[str]:
    """The next `count` ticks after `after`, as Berlin wall-clock times."""
    found: list[str] = []
    for _ in range(count):
        after = next_tick(schedule, after)
        found.append(datetime.fromtimestamp(after, BERLIN).isoformat())
    return found


def test_a_daily_cron_runs_once_on_the_night_the_clocks_go_back() -> None:
    """02:30 happens twice on 31 October 2027 (CEST, then CET): cron runs a fixed-time job at the first."""
    nightly = Schedule(name="n", type="noop", cron="30 2 * * *", timezone="Europe/Berlin")
    assert ticks(nightly, at(2027, 10, 30, 12, 0), 3) == [
        "2027-10-31T02:30:00+02:00", "2027-11-01T02:30:00+01:00", "2027-11-02T02:30:00+01:00"]
    between = at(2027, 10, 31, 1, 0, tz=UTC)  # 02:00 CET: after the first 02:30, before the second
    assert start(nightly, between).next_tick_at == at(2027, 11, 1, 2, 30)


@pytest.mark.parametrize(("cron", "step_s"), [("*/30 * * * *", 1800.0), ("0 * * * *", 3600.0)])
def test_crons_every_half_hour_or_hour_run_through_both_copies_of_the_repeated_hour(cron: str, step_s: float) -> None:
    schedule = Schedule(name="h", type="noop", cron=cron, timezone="Europe/Berlin")
    begin = at(2027, 10, 31, 0, 0, tz=UTC)  # 02:00 CEST; at 01:00 UTC, 03:00 CEST becomes 02:00 CET
    found = ticks(schedule, begin - 1, int(3 * 3600 / step_s) + 1)
    assert found == [datetime.fromtimestamp(begin + i * step_s, BERLIN).isoformat() for i in range(len(found))]
    assert {"2027-10-31T02:00:00+02:00", "2027-10-31T02:00:00+01:00"} <= set(found)  # even spacing, both copies
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
    assert len(firing.fire) + firing.skipped == 5
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


T0 = 1_800_000_000.0    # a whole minute, 2027-01-15T08:00:00Z: the first tick missed
MONTH = 30 * 86400.0    # a month-long stop: 43,201 minutely ticks from T0 to T0 + MONTH


def down_since(first: float, **kw: object) -> Schedule:
    """A schedule that has not fired since `first` (its next tick then)."""
    return replace(Schedule(name="s", type="noop", **kw), next_tick_at=first, next_run_at=first)  # type: ignore[arg-type]


def fire_now(schedule: Schedule, now: float) -> tuple[list[Fired], Schedule, list[NewTask]]:
    added: list[NewTask] = []
    fired, saved = fire(schedule, now, running=lambda _: False,
                        add=lambda new: added.append(new) or f"t{len(added)}")
    return fired, saved, added


MINUTELY = [{"every_s": 60.0}, {"cron": "* * * * *"}]


@pytest.mark.parametrize("timing", MINUTELY, ids=["every_s", "cron"])
@pytest.mark.parametrize(("catch_up", "fired"), [("last", 1), ("all", MAX_CATCH_UP), ("none", 0)])
def test_a_month_down_fires_by_catch_up_in_one_pass(timing: dict[str, object], catch_up: str, fired: int) -> None:
    schedule = down_since(T0, catch_up=catch_up, **timing)
    latest = T0 + MONTH
    outcome, saved, added = fire_now(schedule, latest + 30.0)  # the latest tick 30 s ago: too late for "none"
    ticks_fired = [latest - 60.0 * i for i in reversed(range(fired))]
    assert [f.tick for f in outcome if f.task_id] == ticks_fired
    assert [new.idempotency_key for new in added] == [tick_key(schedule, t) for t in ticks_fired]
    (missed,) = [f for f in outcome if f.reason == "missed"]
    assert missed.tick == latest - 60.0 * fired  # the latest tick it skipped
    # counted exactly for every_s; for cron by walking the ticks, up to MAX_COUNTED
    assert missed.count == (43_201 - fired if "every_s" in timing else MAX_COUNTED)
    assert saved.next_tick_at == latest + 60.0
    # The backlog is settled in that one pass: the next finds nothing, then the next tick fires alone.
    assert fire_now(saved, latest + 30.5)[0] == []
    later, _, _ = fire_now(saved, latest + 60.5)
    assert [(f.tick, f.reason) for f in later] == [(latest + 60.0, None)]


@pytest.mark.parametrize("timing", MINUTELY, ids=["every_s", "cron"])
@pytest.mark.parametrize(("catch_up", "most"), [("last", 1), ("all", MAX_CATCH_UP), ("none", 0)])
@pytest.mark.parametrize("due", [1, 2, 11, 12, 13, 121, 43_201])
def test_what_fires_does_not_depend_on_how_long_the_stop_was(timing: dict[str, object], catch_up: str, most: int,
                                                             due: int) -> None:
    latest = T0 + MONTH
    firing = plan(down_since(latest - 60.0 * (due - 1), catch_up=catch_up, **timing), latest + 30.0)
    fired = min(most, due)
    assert firing.fire == [latest - 60.0 * i for i in reversed(range(fired))]
    assert firing.next_tick_at == latest + 60.0
    exact = due - fired
    assert firing.skipped == (exact if "every_s" in timing else min(exact, MAX_COUNTED))


def test_a_cron_tick_is_never_fired_before_an_earlier_one_that_its_jitter_still_holds_back() -> None:
    """With jitter longer than the period (allowed for cron), a tick can be due before the one before it."""
    schedule = down_since(T0 + MONTH - 7200.0, cron="* * * * *", jitter_s=600.0, catch_up="all")
    for now in (T0 + MONTH + 7.0 * k for k in range(60)):
        # the ticks from an hour back (all due: jitter stays below 600 s), in order, up to the first not due yet
        hour_back = itertools.count(now - now % 60 - 3600, 60.0)
        due = list(itertools.takewhile(lambda t, now=now: t + jitter_of(schedule, t) <= now, hour_back))
        firing = plan(schedule, now)
        assert (firing.fire, firing.next_tick_at) == (due[-MAX_CATCH_UP:], due[-1] + 60.0)


def test_a_one_second_schedule_a_month_down_fires_its_current_tick_at_once() -> None:
    now = T0 + MONTH + 0.5
    fired, saved, _ = fire_now(down_since(T0, every_s=1.0), now)
    assert [(f.tick, f.reason, f.count) for f in fired] == [(now - 1.5, "missed", int(MONTH)), (now - 0.5, None, 1)]
    assert saved.next_tick_at == now + 0.5


@pytest.mark.parametrize("timing", MINUTELY, ids=["every_s", "cron"])
def test_a_tick_whose_jitter_puts_it_after_now_waits_after_a_long_stop(timing: dict[str, object]) -> None:
    schedule = down_since(T0, jitter_s=50.0, **timing)
    latest = next(t for t in (T0 + MONTH - 60.0 * i for i in range(100)) if jitter_of(schedule, t) > 1.0)
    now = latest + jitter_of(schedule, latest) - 0.5  # `latest` is due half a second from now
    firing = plan(schedule, now)
    assert firing.fire == [latest - 60.0] and firing.last_skipped == latest - 120.0
    assert (firing.next_tick_at, firing.next_run_at) == (latest, latest + jitter_of(schedule, latest))
    assert plan(replace(schedule, next_tick_at=firing.next_tick_at), now + 0.5).fire == [latest]


def test_catch_up_across_the_night_the_clocks_go_back_fires_no_repeat_of_a_fixed_time() -> None:
    nightly = down_since(at(2027, 10, 20, 2, 30), cron="30 2 * * *", timezone="Europe/Berlin", catch_up="all")
    firing = plan(nightly, at(2027, 11, 2, 12, 0))  # 14 nights missed: found stepping back from now
    assert [datetime.fromtimestamp(t, BERLIN).isoformat() for t in firing.fire] == \
        [f"2027-10-{day}T02:30:00+02:00" for day in range(24, 32)] + \
        ["2027-11-01T02:30:00+01:00", "2027-11-02T02:30:00+01:00"]
    assert (firing.skipped, firing.last_skipped) == (4, at(2027, 10, 23, 2, 30))


def test_overlap_skip_skips_while_the_previous_task_runs() -> None:
    schedule = replace(start(every(60.0, overlap="skip"), 0.0), last_task_id="busy")
    added: list[NewTask] = []
    fired, saved = fire(schedule, 61.0, running=lambda task_id: task_id == "busy",
                        add=lambda new: added.append(new) or "t2")
    assert added == [] and fired[0].reason == "overlap" and saved.last_task_id == "busy"
    fired, saved = fire(saved, 121.0, running=lambda _: False, add=lambda new: "t3")
    assert fired[0].task_id == "t3" and saved.last_task_id == "t3"


def test_a_tick_fires_one_task_with_its_idempotency_key_and_its_type_s_attempt_budget() -> None:
    schedule = start(every(60.0), 0.0)
    added: list[NewTask] = []
    budgets = {schedule.type: 1}
    fire(schedule, 60.0, new_task=lambda s, tick: task_for(s, tick, max_attempts=budgets[s.type]),
         running=lambda _: False, add=lambda new: added.append(new) or "t")
    assert [(n.idempotency_key, n.max_attempts) for n in added] == [("schedule:s:1970-01-01T00:01:00+00:00", 1)]


def test_jitter_is_the_same_on_every_node_and_within_bounds() -> None:
    """Nodes fire a tick at the moment each derives alike: from the schedule's name and the tick, never from
    anything of its own process (a hash seed, a start time, an address)."""
    schedule = every(60.0, jitter_s=10.0)
    ticks = [60.0, 120.0, 180.0]
    offsets = [jitter_of(schedule, t) for t in ticks]
    assert all(0 <= o < 10 for o in offsets) and len(set(offsets)) == 3
    assert jitter_of(schedule, 60.0) == jitter_of(replace(schedule), 60.0)
    for hash_seed in ("1", "2"):  # other processes, as other nodes are: str hashes differ in each
        assert jitter_in_another_process(ticks, hash_seed) == offsets


def jitter_in_another_process(ticks: list[float], hash_seed: str) -> list[float]:
    """jitter_of(every(60.0, jitter_s=10.0), tick) for each tick, as a fresh interpreter computes it."""
    program = ("import json, sys; from tidepool.schedules import Schedule, jitter_of; "
               "s = Schedule(name='s', type='noop', every_s=60.0, jitter_s=10.0); "
               "print(json.dumps([jitter_of(s, t) for t in json.loads(sys.argv[1])]))")
    done = subprocess.run([sys.executable, "-c", program, json.dumps(ticks)], capture_output=True, text=True,
                          timeout=30, env={**os.environ, "PYTHONHASHSEED": hash_seed}, check=True)
    offsets: list[float] = json.loads(done.stdout)
    return offsets


@pytest.mark.parametrize(("schedule", "field"), [
    (Schedule(name="x", type="noop"), "cron"),
    (Schedule(name="x", type="noop", cron="* *", every_s=None), "cron"),
    (Schedule(name="x", type="noop", cron="0 * * * *", every_s=5.0), "cron"),
    (Schedule(name="x", type="noop", every_s=5.0, timezone="Mars/Olympus"), "timezone"),
    # a tick delayed past the next one would make that one look missed while the daemon runs
    (Schedule(name="x", type="noop", every_s=60.0, jitter_s=60.0), "jitter_s"),
    (Schedule(name="x", type="noop", every_s=60.0, jitter_s=90.0), "jitter_s"),
    (Schedule(name="x", type="noop", cron="0 2 * * *", jitter_s=math.nan), "jitter_s"),
    (Schedule(name="a/b c", type="noop", every_s=60.0), "name"),  # as the API refuses it
    (Schedule(name="", type="noop", every_s=60.0), "name"),
    (Schedule(name="x" * 201, type="noop", every_s=60.0), "name"),
])
def test_invalid_schedules_name_the_field(schedule: Schedule, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate(schedule)
    assert info.value.field == field


def test_jitter_below_the_period_and_every_name_the_api_takes_are_accepted() -> None:
    validate(Schedule(name="nightly-scan.v2:eu_1", type="noop", every_s=60.0, jitter_s=59.5))
    validate(Schedule(name="x" * 200, type="noop", cron="0 2 * * *", jitter_s=3600.0))  # cron: as before


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
