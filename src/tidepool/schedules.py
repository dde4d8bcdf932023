"""Periodic schedules: their definition and the pure arithmetic of ticks (cron or every_s, per time zone).

A tick is identified by its unjittered time; the task a tick creates carries the idempotency key
`schedule:<name>:<tick>`, so even a repeated claim of the same tick cannot create a second task.
The scheduler loop that fires due ticks lives in scheduler.py; stores fire them transactionally.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter  # type: ignore[import-untyped]

from .errors import InvalidRequest
from .model import NewTask, rfc3339

MIN_EVERY_S = 1.0         # shorter periods are not what a schedule is for (and overflow the tick arithmetic)
MAX_CATCH_UP = 10          # catch_up = "all" fires at most this many missed ticks at once
ON_TIME_GRACE_S = 5.0      # catch_up = "none" still fires a tick this late (at most half a period)
CatchUp = Literal["none", "last", "all"]
Overlap = Literal["allow", "skip"]


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    type: str
    payload: dict[str, Any] = field(default_factory=dict)
    cron: str | None = None
    every_s: float | None = None
    timezone: str = "UTC"
    jitter_s: float = 0.0
    catch_up: CatchUp = "last"
    overlap: Overlap = "allow"
    priority: int = 0
    config_node: str | None = None      # the node whose config file defines it; None: the API did
    paused: bool = False
    next_tick_at: float | None = None   # the next tick's identity (unjittered)
    next_run_at: float | None = None    # when that tick is due (tick + jitter)
    last_run_at: float | None = None
    last_task_id: str | None = None

    def same_timing(self, other: Schedule) -> bool:
        return (self.cron, self.every_s, self.timezone, self.jitter_s) == \
            (other.cron, other.every_s, other.timezone, other.jitter_s)

    def to_json(self, *, last_task_state: str | None = None) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "payload": self.payload, "cron": self.cron,
                "every_s": self.every_s, "timezone": self.timezone, "jitter_s": self.jitter_s,
                "catch_up": self.catch_up, "overlap": self.overlap, "priority": self.priority,
                "config_node": self.config_node, "paused": self.paused, "next_run_at": rfc3339(self.next_run_at),
                "last_run_at": rfc3339(self.last_run_at), "last_task_id": self.last_task_id,
                "last_task_state": last_task_state}


@dataclass(frozen=True, slots=True)
class Firing:
    """What one due schedule does now: the ticks to fire, the ticks skipped, and where it goes next."""

    fire: list[float]
    skipped: list[float]
    next_tick_at: float
    next_run_at: float


@dataclass(frozen=True, slots=True)
class Fired:
    schedule: str
    tick: float
    task_id: str | None          # None when skipped
    reason: str | None = None    # why skipped: "overlap", or "missed" (catch_up dropped `count` ticks)
    count: int = 1
    type: str | None = None      # the task's type and priority, when one was created
    priority: int = 0


def validate(schedule: Schedule) -> Schedule:
    """Refuse a schedule that cannot run, naming the field; InvalidRequest is a 400 at the API."""
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
    if schedule.every_s is not None:
        # Anchored on the epoch, so every node computes the same ticks.
        return (math.floor(after / schedule.every_s) + 1) * schedule.every_s
    assert schedule.cron is not None
    start = datetime.fromtimestamp(after, ZoneInfo(schedule.timezone))
    tick: datetime = croniter(schedule.cron, start).get_next(datetime)
    return tick.timestamp()


def jitter_of(schedule: Schedule, tick: float) -> float:
    """A delay in [0, jitter_s) that every node derives alike from the schedule's name and the tick."""
    if schedule.jitter_s <= 0:
        return 0.0
    digest = hashlib.sha256(f"{schedule.name}:{tick}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * schedule.jitter_s


def start(schedule: Schedule, now: float) -> Schedule:
    """A new (or retimed) schedule's first tick: the first one after now (SPEC §9)."""
    tick = next_tick(schedule, now)
    return replace(schedule, next_tick_at=tick, next_run_at=tick + jitter_of(schedule, tick))


def plan(schedule: Schedule, now: float) -> Firing:
    """Which ticks a due schedule fires at `now`, by its catch_up policy; never a burst."""
    assert schedule.next_tick_at is not None
    due: list[float] = []
    tick = schedule.next_tick_at
    while tick + jitter_of(schedule, tick) <= now and len(due) < 10_000:
        due.append(tick)
        tick = next_tick(schedule, tick)
    if not due:
        return Firing([], [], tick, tick + jitter_of(schedule, tick))
    if schedule.catch_up == "all":
        fire = due[-MAX_CATCH_UP:]
    elif schedule.catch_up == "last":
        fire = due[-1:]
    else:
        fire = [t for t in due[-1:] if now - (t + jitter_of(schedule, t)) <= _grace_s(schedule, t)]
    skipped = [t for t in due if t not in fire]
    return Firing(fire, skipped, tick, tick + jitter_of(schedule, tick))


def _grace_s(schedule: Schedule, tick: float) -> float:
    """How late a tick may fire and still count as on time: never more than half its period."""
    return min(ON_TIME_GRACE_S, (next_tick(schedule, tick) - tick) / 2)


def rewound(schedule: Schedule, now: float) -> bool:
    """The clock went back: the next tick is further away than one period from now. Restart from now."""
    if schedule.next_tick_at is None:
        return True
    return next_tick(schedule, now) < schedule.next_tick_at and \
        next_tick(schedule, next_tick(schedule, now)) <= schedule.next_tick_at


SPEC_FIELDS = ("type", "payload", "cron", "every_s", "timezone", "jitter_s", "catch_up", "overlap", "priority",
               "config_node")


def spec_of(schedule: Schedule) -> dict[str, Any]:
    """What defines a schedule, as opposed to its running state (next/last run, paused)."""
    return {f: getattr(schedule, f) for f in SPEC_FIELDS}


def stored_spec(text: str) -> dict[str, Any]:
    """A stored spec_of() as Schedule's fields: what a newer version added is left out, not an error, so
    nodes of two versions can share a store while a fleet is upgraded."""
    return {k: v for k, v in json.loads(text).items() if k in SPEC_FIELDS}


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


def fire(schedule: Schedule, now: float, *, max_attempts: Callable[[str], int], running: Callable[[str], bool],
         add: Callable[[NewTask], str | None]) -> tuple[list[Fired], Schedule]:
    """Fire a due schedule inside the store's transaction: `add` creates a task (None if its tick's
    key exists already), `running` says whether the schedule's last task is still unfinished, and
    `max_attempts` gives a task of a type its attempt budget."""
    if rewound(schedule, now):
        return [], start(schedule, now)
    firing = plan(schedule, now)
    fired = [Fired(schedule.name, firing.skipped[-1], None, "missed", len(firing.skipped))] if firing.skipped else []
    last_task, last_run = schedule.last_task_id, schedule.last_run_at
    for tick in firing.fire:
        if schedule.overlap == "skip" and last_task is not None and running(last_task):
            fired.append(Fired(schedule.name, tick, None, "overlap"))
            continue
        task_id = add(task_for(schedule, tick, max_attempts=max_attempts(schedule.type)))
        if task_id is not None:
            fired.append(Fired(schedule.name, tick, task_id, type=schedule.type, priority=schedule.priority))
            last_task, last_run = task_id, tick
    return fired, replace(schedule, next_tick_at=firing.next_tick_at, next_run_at=firing.next_run_at,
                          last_run_at=last_run, last_task_id=last_task)


def task_for(schedule: Schedule, tick: float, *, max_attempts: int) -> NewTask:
    return NewTask(schedule.type, dict(schedule.payload), schedule.priority, max_attempts, None, (),
                   tick_key(schedule, tick), None)


def tick_key(schedule: Schedule, tick: float) -> str:
    """The idempotency key of a tick's task: one task per tick, however many nodes fire it."""
    return f"schedule:{schedule.name}:{datetime.fromtimestamp(tick, UTC).isoformat()}"
