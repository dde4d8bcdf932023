"""Periodic schedules: their definition and the pure arithmetic of ticks (cron or every_s, per time zone).

A tick is identified by its unjittered time; the task a tick creates carries the idempotency key
`schedule:<name>:<tick>`, so even a repeated claim of the same tick cannot create a second task.
The scheduler loop that fires due ticks is upkeep/scheduler.py; stores fire them transactionally.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter  # type: ignore[import-untyped]

from .errors import InvalidRequest, QueueFull
from .model import NewTask
from .scans import NewScan

MIN_EVERY_S = 1.0         # shorter periods are not what a schedule is for (and overflow the tick arithmetic)
MAX_CATCH_UP = 10          # catch_up = "all" fires at most this many missed ticks at once
MAX_COUNTED = 1000         # a cron schedule's missed ticks are counted by walking them: up to this many
NAME_PATTERN = r"^[A-Za-z0-9_.:-]+$"  # a schedule's name, in config and API alike: it goes into URLs and task keys
MAX_NAME_LEN = 200
ON_TIME_GRACE_S = 5.0      # catch_up = "none" still fires a tick this late (at most half a period)
CatchUp = Literal["none", "last", "all"]
Overlap = Literal["allow", "skip"]


@dataclass(frozen=True, slots=True)
class Schedule:
    """A schedule submits a task of its `type` at each tick, or starts a scan of its `profile`: one of the two."""

    name: str
    type: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    cron: str | None = None
    every_s: float | None = None
    timezone: str = "UTC"
    jitter_s: float = 0.0
    catch_up: CatchUp = "last"
    overlap: Overlap = "allow"
    priority: int = 0
    profile: str | None = None
    config_node: str | None = None      # the node whose config file defines it; None: the API did
    paused: bool = False
    next_tick_at: float | None = None   # the next tick's identity (unjittered)
    next_run_at: float | None = None    # when that tick is due (tick + jitter)
    last_run_at: float | None = None
    last_task_id: str | None = None     # its last task's id; a profile schedule's last scan's

    def same_timing(self, other: Schedule) -> bool:
        return (self.cron, self.every_s, self.timezone, self.jitter_s) == \
            (other.cron, other.every_s, other.timezone, other.jitter_s)


@dataclass(frozen=True, slots=True)
class Firing:
    """What one due schedule does now: the ticks to fire, the ticks skipped, and where it goes next."""

    fire: list[float]
    skipped: int                   # due ticks catch_up drops: exact for every_s, at most MAX_COUNTED for cron
    last_skipped: float | None     # the latest of them
    next_tick_at: float
    next_run_at: float


@dataclass(frozen=True, slots=True)
class Fired:
    schedule: str
    tick: float
    task_id: str | None          # None when skipped
    reason: str | None = None    # why skipped: "overlap", "queue_full", "refused" (its scan could not be made),
                                 # or "missed" (catch_up dropped `count`)
    count: int = 1               # for a cron schedule's "missed", at most MAX_COUNTED (Firing.skipped)
    type: str | None = None      # the task's type and priority, when one was created
    priority: int = 0
    scan_id: str | None = None   # the scan a profile schedule started (task_id is None then)


def validate(schedule: Schedule) -> Schedule:
    """Refuse a schedule that cannot run, naming the field; InvalidRequest is a 400 at the API."""
    if not (re.fullmatch(NAME_PATTERN, schedule.name) and len(schedule.name) <= MAX_NAME_LEN):
        raise InvalidRequest("name", f"{schedule.name!r} is not a schedule name: 1 to {MAX_NAME_LEN} letters, "
                                     "digits and _ . : -")
    if (schedule.type is None) == (schedule.profile is None):
        raise InvalidRequest("type", "set exactly one of type (a task to submit) or profile (a scan to start)")
    if (schedule.cron is None) == (schedule.every_s is None):
        raise InvalidRequest("cron", "set exactly one of cron or every_s")
    if schedule.cron is not None and not schedule.cron.startswith("@") and (fields := len(schedule.cron.split())) != 5:
        # croniter would read a sixth field as seconds (and a seventh as years): ticks every second,
        # below the floor of every_s, and documented nowhere. A cron here is the classic five fields
        # (or an alias such as @daily).
        raise InvalidRequest("cron", f"{schedule.cron!r} must have five fields, minute hour day-of-month "
                                     f"month day-of-week, not {fields}")
    if schedule.cron is not None and not croniter.is_valid(schedule.cron):
        raise InvalidRequest("cron", f"not a cron expression: {schedule.cron!r}")
    if schedule.every_s is not None and not (math.isfinite(schedule.every_s) and schedule.every_s >= MIN_EVERY_S):
        raise InvalidRequest("every_s", f"must be at least {MIN_EVERY_S:g} second")
    if not (math.isfinite(schedule.jitter_s) and schedule.jitter_s >= 0):
        raise InvalidRequest("jitter_s", f"must be a number of seconds, 0 or more, not {schedule.jitter_s}")
    if schedule.every_s is not None and schedule.jitter_s >= schedule.every_s:
        # A tick delayed past the next one would find that one due too: catch_up would count it missed.
        raise InvalidRequest("jitter_s", f"{schedule.jitter_s:g} must be below every_s ({schedule.every_s:g})")
    try:
        json.dumps(schedule.payload, allow_nan=False)
    except (TypeError, ValueError) as exc:  # a TOML date, say: tasks carry JSON
        raise InvalidRequest("payload", f"must be JSON: {exc}") from None
    try:
        ZoneInfo(schedule.timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidRequest("timezone", f"unknown time zone {schedule.timezone!r}") from None
    if schedule.cron is not None:
        try:  # croniter accepts expressions that never match, such as "0 0 30 2 *"
            next_tick(schedule, time.time())
        except (ValueError, KeyError, OverflowError) as exc:
            raise InvalidRequest("cron", f"{schedule.cron!r} never fires: {exc}") from None
    return schedule


def next_tick(schedule: Schedule, after: float) -> float:
    """The first tick strictly after `after` (epoch seconds)."""
    return next(_ticks_after(schedule, after))


def _ticks_after(schedule: Schedule, after: float) -> Iterator[float]:
    """The ticks strictly after `after`, in order."""
    if schedule.every_s is not None:
        # Anchored on the epoch, so every node computes the same ticks: tick k is at k * every_s.
        return (k * schedule.every_s for k in itertools.count(_index(schedule.every_s, after) + 1))
    return _cron_ticks(schedule, after, back=False)


def _ticks_back_from(schedule: Schedule, at: float) -> Iterator[float]:
    """The ticks at or before `at`, latest first."""
    if schedule.every_s is not None:
        return (k * schedule.every_s for k in itertools.count(_index(schedule.every_s, at), -1))
    return _cron_ticks(schedule, at, back=True)


def _index(every_s: float, t: float) -> int:
    """The k of the every_s tick at or before t: k * every_s <= t < (k + 1) * every_s."""
    k = math.floor(t / every_s)
    # The division can round across a whole number; the products are the ticks, so settle k on them.
    return k - 1 if k * every_s > t else k + 1 if (k + 1) * every_s <= t else k


def _cron_ticks(schedule: Schedule, start: float, *, back: bool) -> Iterator[float]:
    """Cron ticks after `start` (back: at or before it, latest first), walked by one croniter."""
    assert schedule.cron is not None
    zone = ZoneInfo(schedule.timezone)
    # croniter steps strictly past its start; ticks fall on whole seconds, so "at or before start"
    # is "before floor(start) + 1".
    it = croniter(schedule.cron, datetime.fromtimestamp(math.floor(start) + 1 if back else start, zone))
    step = it.get_prev if back else it.get_next
    # As cron (vixie, cronie) does when the clocks go back: a job at a fixed local time runs at the
    # first of the two moments that bear it; one whose minute or hour field starts with "*" (every
    # minute, every hour, */15) keeps running in real time, through both copies of the hour.
    minute, hour = it.expressions[:2]
    once = not (minute.startswith("*") or hour.startswith("*"))
    while True:
        tick: float = step(float)
        if not (once and datetime.fromtimestamp(tick, zone).fold):  # fold: the second copy of a wall time
            yield tick


def jitter_of(schedule: Schedule, tick: float) -> float:
    """A delay in [0, jitter_s) that every node derives alike from the schedule's name and the tick."""
    if schedule.jitter_s <= 0:
        return 0.0
    digest = hashlib.sha256(f"{schedule.name}:{tick}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * schedule.jitter_s


def start(schedule: Schedule, now: float) -> Schedule:
    """A new (or retimed) schedule's first tick: the first one after now."""
    tick = next_tick(schedule, now)
    return replace(schedule, next_tick_at=tick, next_run_at=tick + jitter_of(schedule, tick))


def plan(schedule: Schedule, now: float) -> Firing:
    """Which ticks a due schedule fires at `now`, by its catch_up policy; never a burst. However long
    the schedule was down, one pass decides from the latest due ticks and a count of the others."""
    assert schedule.next_tick_at is not None
    first = schedule.next_tick_at
    due = _latest_due(schedule, first, now)
    if not due:
        return Firing([], 0, None, first, first + jitter_of(schedule, first))
    last, after = due[0], next_tick(schedule, due[0])
    if schedule.catch_up == "all":
        keep = MAX_CATCH_UP
    elif schedule.catch_up == "last":
        keep = 1
    else:  # "none" still fires a tick that is on time, never later than half a period
        keep = int(now - (last + jitter_of(schedule, last)) <= min(ON_TIME_GRACE_S, (after - last) / 2))
    fire, missed = due[:keep][::-1], due[keep] if len(due) > keep else None
    skipped = 0 if missed is None else _count(schedule, first, missed)
    return Firing(fire, skipped, missed, after, after + jitter_of(schedule, after))


def _latest_due(schedule: Schedule, first: float, now: float) -> list[float]:
    """The latest due ticks from `first` on, latest first, at most MAX_CATCH_UP + 1 of them. A tick is
    due when tick + its jitter <= now; ticks fire in order, so one not due yet holds back those after it."""
    # Most passes find a tick or two: walk forward from `first`, tick by tick.
    walked: list[float] = []
    for tick in itertools.chain([first], _ticks_after(schedule, first)):
        if tick + jitter_of(schedule, tick) > now:
            return walked[::-1]
        if len(walked) == MAX_CATCH_UP + 1:
            break
        walked.append(tick)
    # A longer backlog (a long stop): step back from now instead of walking all of it.
    due: list[float] = []
    for tick in _ticks_back_from(schedule, now):
        if tick < first:
            break
        if tick + jitter_of(schedule, tick) > now:
            due.clear()  # not due yet: neither it nor any tick after it fires now
        elif len(due) <= MAX_CATCH_UP:
            due.append(tick)
        if len(due) > MAX_CATCH_UP and tick + schedule.jitter_s <= now:
            break  # every earlier tick is due too: jitter is below jitter_s
    return due


def _count(schedule: Schedule, first: float, last: float) -> int:
    """How many ticks lie in [first, last]: counted for every_s; walked for cron, up to MAX_COUNTED."""
    if schedule.every_s is not None:
        return _index(schedule.every_s, last) - _index(schedule.every_s, first) + 1
    later = itertools.takewhile(lambda tick: tick <= last, _ticks_after(schedule, first))
    return 1 + sum(1 for _ in itertools.islice(later, MAX_COUNTED - 1))


DEFINING_FIELDS = ("type", "payload", "cron", "every_s", "timezone", "jitter_s", "catch_up", "overlap", "priority",
                   "profile", "config_node")


def spec_of(schedule: Schedule) -> dict[str, Any]:
    """What defines a schedule, as opposed to its running state (next/last run, paused)."""
    return {f: getattr(schedule, f) for f in DEFINING_FIELDS}


def stored_spec(text: str) -> dict[str, Any]:
    """A stored spec_of() as Schedule's fields: what a newer version added is left out, not an error, so
    nodes of two versions can share a store while a fleet is upgraded."""
    return {k: v for k, v in json.loads(text).items() if k in DEFINING_FIELDS}


def merge(existing: Schedule | None, incoming: Schedule, now: float) -> Schedule:
    """Save `incoming` over `existing`: its state survives unless the timing changed."""
    if existing is None:
        return start(incoming, now)
    kept = replace(incoming, paused=existing.paused, next_tick_at=existing.next_tick_at,
                   next_run_at=existing.next_run_at, last_run_at=existing.last_run_at,
                   last_task_id=existing.last_task_id)
    return kept if existing.same_timing(incoming) else start(kept, now)


def set_paused(schedule: Schedule, paused: bool, now: float) -> Schedule:
    """Pause, or resume at the next tick after now: ticks that passed while paused do not fire."""
    if paused:
        return replace(schedule, paused=True)
    return start(replace(schedule, paused=False), now)


def fire(schedule: Schedule, now: float, *, running: Callable[[str], bool],
         add: Callable[[NewTask | NewScan], str | None],
         new_task: Callable[[Schedule, float], NewTask | NewScan] | None = None,
         firing: Firing | None = None) -> tuple[list[Fired], Schedule]:
    """Fire a due schedule inside the store's transaction: `add` creates a task or, for a profile schedule, a
    scan (its id; None if its tick's key exists already), `running` says whether the schedule's last task
    (or scan) is still unfinished, and `new_task` makes a tick's task as the node would a submit of its type
    (task_for by default), or its scan as a submit of its profile.
    `firing`: plan(schedule, now), when the caller needed it first (a cron backlog's plan walks up to
    MAX_COUNTED ticks)."""
    new_task = new_task or task_for
    if firing is None:
        firing = plan(schedule, now)
    fired = [Fired(schedule.name, firing.last_skipped, None, "missed", firing.skipped)] \
        if firing.last_skipped is not None else []
    last_task, last_run = schedule.last_task_id, schedule.last_run_at
    for tick in firing.fire:
        if schedule.overlap == "skip" and last_task is not None and running(last_task):
            fired.append(Fired(schedule.name, tick, None, "overlap"))
            continue
        try:
            task_id = add(new_task(schedule, tick))
        except QueueFull:  # refused as a submit would be; the tick is not tried again
            fired.append(Fired(schedule.name, tick, None, "queue_full"))
            continue
        except InvalidRequest:  # its scan cannot be made now (a reload changed its profile's first step): likewise
            fired.append(Fired(schedule.name, tick, None, "refused"))
            continue
        if task_id is not None and schedule.profile is not None:
            fired.append(Fired(schedule.name, tick, None, priority=schedule.priority, scan_id=task_id))
            last_task, last_run = task_id, tick
        elif task_id is not None:
            fired.append(Fired(schedule.name, tick, task_id, type=schedule.type, priority=schedule.priority))
            last_task, last_run = task_id, tick
    return fired, replace(schedule, next_tick_at=firing.next_tick_at, next_run_at=firing.next_run_at,
                          last_run_at=last_run, last_task_id=last_task)


def task_for(schedule: Schedule, tick: float, *, max_attempts: int = 3,
             required_tags: frozenset[str] = frozenset()) -> NewTask:
    """A tick's task: its type's attempt budget and required tags are the node's to give (as to a submit)."""
    assert schedule.type is not None, "a profile schedule starts scans"
    return NewTask(schedule.type, dict(schedule.payload), schedule.priority, max_attempts, None,
                   tuple(sorted(required_tags)), tick_key(schedule, tick), None)


def tick_key(schedule: Schedule, tick: float) -> str:
    """The idempotency key of a tick's task (or scan): one per tick, however many nodes fire it."""
    return f"schedule:{schedule.name}:{datetime.fromtimestamp(tick, UTC).isoformat()}"
