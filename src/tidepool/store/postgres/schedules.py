"""The schedules: saved, listed, paused and deleted, and each due one fired in a transaction of its own.

A firing holds its schedule's row (FOR UPDATE SKIP LOCKED), so of several nodes firing at once one fires
each due schedule and the others skip it; a tick's task or scan goes in with the schedule's next run, in
that transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ... import schedules
from ...errors import QueueFull, ScheduleNotFound, StoreUnavailable
from ...model import NewTask, new_id
from ...scans import NewScan
from ...schedules import Fired, Schedule
from .. import sql
from ..rows import schedule_of, schedule_values
from . import scans, tasks
from .database import Conn, Database

SQL = sql.queries(__package__, "schedules.sql")


async def save_schedule(db: Database, schedule: Schedule, *, now: float) -> Schedule:
    async with db.conn() as conn, conn.transaction():
        saved = schedules.merge(await _locked(conn, schedule.name), schedule, now)
        await conn.execute(SQL["save_schedule"], *schedule_values(saved))
    return saved


async def list_schedules(db: Database) -> list[Schedule]:
    async with db.conn() as conn:
        rows = await conn.fetch(SQL["list_schedules"])
    return [schedule_of(r) for r in rows]


async def delete_schedule(db: Database, name: str, *, config_node: str | None) -> None:
    async with db.conn() as conn:
        if await conn.fetchval(SQL["delete_schedule"], name, config_node) is None:
            raise ScheduleNotFound(name)


async def pause_schedule(db: Database, name: str, *, paused: bool, now: float) -> Schedule:
    async with db.conn() as conn, conn.transaction():
        existing = await _locked(conn, name)
        if existing is None:
            raise ScheduleNotFound(name)
        saved = schedules.set_paused(existing, paused, now)
        await conn.execute(SQL["save_schedule"], *schedule_values(saved))
    return saved


async def fire_schedules(db: Database, *, now: float, new_task: Callable[[Schedule, float], NewTask | NewScan] | None,
                         defines: Callable[[Schedule], bool], max_queued: int | None) -> list[Fired]:
    async with db.conn() as conn:
        due = await conn.fetch(SQL["due_schedules"], now)
    fired: list[Fired] = []
    for name, spec in due:
        if not defines(Schedule(name, **schedules.stored_spec(spec))):
            continue  # a node that defines the type fires it
        async with db.conn() as conn, conn.transaction():  # each a call of its own, within the deadline
            these = await _fire(conn, name, now, new_task, max_queued)
            if created := sum(1 for f in these if f.task_id is not None or f.scan_id is not None):
                await tasks.notify(conn, created)
        fired.extend(these)
    return fired


async def _locked(conn: Conn, name: str) -> Schedule | None:
    row = await conn.fetchrow(SQL["locked_schedule"], name)
    return None if row is None else schedule_of(row)


async def _fire(conn: Conn, name: str, now: float, new_task: Callable[[Schedule, float], NewTask | NewScan] | None,
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
        taken = {key for key in keys if await scans.key_used(conn, key)}
    else:
        taken = {r[0] for r in await conn.fetch(SQL["keys_taken"], keys)}
    last_active = schedule.last_task_id is not None and await _active(conn, schedule, schedule.last_task_id)
    created: dict[str, NewTask | NewScan] = {}
    room = None if max_queued is None or not ticks else max_queued - await tasks.queued(conn, max_queued)

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
            scan, fresh = await scans.insert(conn, new, now, max_queued)
            scan_ids[task_id] = scan.id
        else:
            fresh = await tasks.inserted(conn, new, now, task_id)
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
        return await scans.running(conn, last_id)
    return bool(await conn.fetchval(SQL["active"], last_id))
