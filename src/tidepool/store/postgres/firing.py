"""Firing one due schedule in a transaction of its own, holding its row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ... import schedules
from ...errors import QueueFull, StoreUnavailable
from ...model import NewTask, new_id
from ...scans import NewScan, ScanState
from ...schedules import Fired, Schedule
from ..rows import schedule_of, schedule_values
from . import scans
from .connection import Conn
from .queue import insert_args, queued
from .statements import SQL


async def fire(conn: Conn, name: str, now: float, new_task: Callable[[Schedule, float], NewTask | NewScan] | None,
               max_queued: int | None) -> list[Fired]:
    """Fire one due schedule; nothing when another node holds or has just fired it."""
    row = await conn.fetchrow(SQL["due_schedule"], name, now)
    if row is None:
        return []
    schedule = schedule_of(row)
    # schedules.fire() asks its questions synchronously: answer them from what the store holds now.
    firing = schedules.plan(schedule, now)
    ticks = firing.fire
    keys = [schedules.tick_key(schedule, t) for t in ticks]
    if schedule.profile is not None:  # a scan's key is its own, not a task's
        taken = {key for key in keys if await conn.fetchrow(SQL["scan_by_key"], key) is not None}
    else:
        taken = {r[0] for r in await conn.fetch(SQL["keys_taken"], keys)}
    last_active = schedule.last_task_id is not None and await _active(conn, schedule, schedule.last_task_id)
    created: dict[str, NewTask | NewScan] = {}
    room = None if max_queued is None or not ticks else max_queued - await queued(conn, max_queued)

    def add(new: NewTask | NewScan) -> str | None:
        nonlocal room
        if new.idempotency_key in taken:
            return None
        if room is not None:
            if room <= 0:
                raise QueueFull(f"pool.max_queued is {max_queued}")
            room -= 1
        task_id = new_id(now)
        created[task_id] = new
        return task_id

    def running(task_id: str) -> bool:
        return task_id in created or (task_id == schedule.last_task_id and bool(last_active))

    fired, saved = schedules.fire(schedule, now, new_task=new_task, running=running, add=add, firing=firing)
    scan_ids: dict[str, str] = {}  # a scan gets its id from the store: the one fire() was told stands in for it
    for task_id, new in created.items():
        if isinstance(new, NewScan):
            scan, fresh = await scans.add_scan(conn, new, now, max_queued)
            scan_ids[task_id] = scan.id
        else:
            fresh = await conn.fetchrow(SQL["insert"], *insert_args(new, now, task_id)) is not None
        if not fresh:
            # Only a submit that borrowed this tick's key can get here: give up this pass, retry the next.
            raise StoreUnavailable(f"schedule {name!r}: key {new.idempotency_key!r} was taken meanwhile; will retry")
    if scan_ids:
        fired = [replace(f, scan_id=scan_ids.get(f.scan_id or "", f.scan_id)) for f in fired]
        saved = replace(saved, last_task_id=scan_ids.get(saved.last_task_id or "", saved.last_task_id))
    await conn.execute(SQL["save_schedule"], *schedule_values(saved))
    return fired


async def _active(conn: Conn, schedule: Schedule, last_id: str) -> bool:
    """Whether the schedule's last task (a profile schedule's: scan) has not ended yet."""
    if schedule.profile is not None:
        row = await conn.fetchrow(SQL["scan"], last_id)
        return row is not None and not ScanState(row[2]).ended
    return bool(await conn.fetchval(SQL["active"], last_id))
