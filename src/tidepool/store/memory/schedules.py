"""The memory store's schedules: saved by name, listed, paused, and their due ticks fired once."""

from __future__ import annotations

from collections.abc import Callable

from ... import schedules
from ...errors import Conflict, ScheduleNotFound
from ...model import NewTask
from ...scans import NewScan
from ...schedules import Fired, Schedule
from ..rules import check_inputs
from . import scans
from .database import Database, check_room, insert


def save_schedule(db: Database, schedule: Schedule, *, now: float) -> Schedule:
    saved = schedules.merge(db.schedules.get(schedule.name), schedule, now)
    db.schedules[schedule.name] = saved
    return saved


def list_schedules(db: Database) -> list[Schedule]:
    return [db.schedules[n] for n in sorted(db.schedules)]


def delete_schedule(db: Database, name: str, *, config_node: str | None) -> None:
    schedule = db.schedules.get(name)
    if schedule is None or (config_node is not None and schedule.config_node != config_node):
        raise ScheduleNotFound(name)
    del db.schedules[name]


def pause_schedule(db: Database, name: str, *, paused: bool, now: float) -> Schedule:
    if name not in db.schedules:
        raise ScheduleNotFound(name)
    db.schedules[name] = schedules.set_paused(db.schedules[name], paused, now)
    return db.schedules[name]


def fire_schedules(db: Database, *, now: float, new_task: Callable[[Schedule, float], NewTask | NewScan] | None,
                   defines: Callable[[Schedule], bool], max_queued: int | None) -> list[Fired]:
    def add(new: NewTask | NewScan) -> str | None:
        if isinstance(new, NewScan):
            try:  # a tick's scan exists already, with this body or an earlier one: the tick has fired
                scan, created = scans.add_scan(db, new, now=now, max_queued=max_queued)
            except Conflict:
                return None
            return scan.id if created else None
        if new.idempotency_key in db.task_keys:
            return None
        check_room(db, 1, max_queued)
        check_inputs(new.inputs, db.blobs)
        return insert(db, new, now).id

    def running(started: str) -> bool:
        if started in db.scans:
            return not db.scans[started].state.ended
        return started in db.tasks and not db.tasks[started].task.state.terminal

    fired: list[Fired] = []
    for schedule in list(db.schedules.values()):
        if schedule.paused or schedule.next_run_at is None or schedule.next_run_at > now:
            continue
        if not defines(schedule):
            continue
        outcome, saved = schedules.fire(schedule, now, new_task=new_task, running=running, add=add)
        db.schedules[schedule.name] = saved
        fired.extend(outcome)
    return fired
