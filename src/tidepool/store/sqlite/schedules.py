"""Schedules in the SQLite store: saved, listed, deleted and paused, and their due ticks fired, each tick's task
(or a profile schedule's scan) made in the transaction that advances the schedule."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from ...errors import Conflict, ScheduleNotFound
from ...model import NewTask, State
from ...scans import NewScan, ScanState
from ...schedules import Fired, Schedule, fire, merge, set_paused
from .. import sql
from ..rows import schedule_of, schedule_values
from . import scans, tasks
from .database import Batch

Q = sql.queries(__package__, "schedules.sql")


def save_schedule(conn: sqlite3.Connection, batch: Batch, *, schedule: Schedule, now: float) -> Schedule:
    row = conn.execute(Q["schedule"], (schedule.name,)).fetchone()
    saved = merge(None if row is None else schedule_of(row), schedule, now)
    conn.execute(Q["save_schedule"], schedule_values(saved))
    return saved


def list_schedules(conn: sqlite3.Connection) -> list[Schedule]:
    return [schedule_of(r) for r in conn.execute(Q["schedules"])]


def delete_schedule(conn: sqlite3.Connection, batch: Batch, *, name: str, config_node: str | None) -> None:
    if conn.execute(Q["delete_schedule"], (name, config_node, config_node)).rowcount == 0:
        raise ScheduleNotFound(name)


def pause_schedule(conn: sqlite3.Connection, batch: Batch, *, name: str, paused: bool, now: float) -> Schedule:
    row = conn.execute(Q["schedule"], (name,)).fetchone()
    if row is None:
        raise ScheduleNotFound(name)
    saved = set_paused(schedule_of(row), paused, now)
    conn.execute(Q["save_schedule"], schedule_values(saved))
    return saved


def fire_schedules(conn: sqlite3.Connection, batch: Batch, *, now: float,
                   new_task: Callable[[Schedule, float], NewTask | NewScan] | None,
                   defines: Callable[[Schedule], bool], max_queued: int | None) -> list[Fired]:
    """Fire every due tick in one transaction: tasks created and next_run_at advanced together."""
    fired: list[Fired] = []
    for row in conn.execute(Q["due_schedules"], (now,)).fetchall():
        schedule = schedule_of(row)
        if not defines(schedule):
            continue
        outcome, saved = fire(schedule, now, new_task=new_task, running=lambda task_id: _unfinished(conn, task_id),
                              add=lambda new: _add_once(conn, batch, new, now, max_queued))
        conn.execute(Q["save_schedule"], schedule_values(saved))
        fired.extend(outcome)
    if fired:
        batch.queued = None
    return fired


def _unfinished(conn: sqlite3.Connection, started: str) -> bool:
    """Whether the task (or, for a profile schedule, the scan) a schedule started last has not ended."""
    scan = conn.execute(Q["started_scan"], (started,)).fetchone()
    if scan is not None:
        return not ScanState(scan[0]).ended
    row = conn.execute(Q["started_task"], (started,)).fetchone()
    return row is not None and not State(row[0]).terminal


def _add_once(conn: sqlite3.Connection, batch: Batch, new: NewTask | NewScan, now: float,
              max_queued: int | None) -> str | None:
    """The new task's (or scan's) id, or None when one for this key exists already (a tick fires once);
    QueueFull past max_queued."""
    if isinstance(new, NewScan):
        try:  # a tick's scan exists already, with this body or an earlier one: the tick has fired
            scan, created = scans.add_scan(conn, batch, new=new, now=now, max_queued=max_queued)
        except Conflict:
            return None
        return scan.id if created else None
    if conn.execute(Q["key_used"], (new.idempotency_key,)).fetchone():
        return None
    tasks.make_room(conn, batch, 1, max_queued)
    return tasks.insert(conn, [new], now)[0]
