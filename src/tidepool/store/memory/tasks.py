"""The memory store's tasks: producers and readers of the task rows, cancels and retries."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ...errors import Conflict, TaskNotFound
from ...model import NewTask, State, Task
from .. import rules
from ..port import CancelAnswer, Page
from . import scans
from .database import Database, TaskRow, cancel, check_room, insert


def add(db: Database, new: NewTask, *, now: float, max_queued: int | None) -> tuple[Task, bool]:
    existing = _existing(db, new)
    if existing is not None:
        return existing, False
    check_room(db, 1, max_queued)
    rules.check_inputs(new.inputs, db.blobs)
    return insert(db, new, now), True


def add_many(db: Database, batch: Sequence[NewTask], *, now: float, max_queued: int | None) -> list[tuple[str, bool]]:
    keys = [n.idempotency_key for n in batch if n.idempotency_key]
    if len(keys) != len(set(keys)):
        raise Conflict("idempotency_key repeats within the batch")
    existing = {n.idempotency_key: task.id for n in batch if (task := _existing(db, n)) is not None}
    fresh = [n for n in batch if n.idempotency_key not in existing]
    if fresh:  # a batch sent again whole is answered even when the queue is full
        check_room(db, len(fresh), max_queued)
    for new in fresh:
        rules.check_inputs(new.inputs, db.blobs)
    return rules.batch_answer(batch, existing, [insert(db, n, now).id for n in fresh])


def get(db: Database, task_id: str) -> Task:
    row = _row(db, task_id)
    return dataclasses.replace(row.task, attempts=tuple(row.attempts), results=tuple(row.results),
                               artifacts=tuple(row.artifacts))


def list_tasks(db: Database, *, state: State | None, type: str | None, limit: int, cursor: str | None,
               organization: str | None) -> Page:
    ids = sorted(db.tasks, reverse=True)
    picked = [db.tasks[i] for i in ids if (cursor is None or i < cursor)
              and (state is None or db.tasks[i].task.state is state)
              and (type is None or db.tasks[i].task.type == type)
              and (organization is None or db.tasks[i].task.organization == organization)][: limit + 1]
    tasks = [dataclasses.replace(r.task, attempts=tuple(r.attempts)) for r in picked[:limit]]
    return Page(tasks, tasks[-1].id if len(picked) > limit else None)


def counts(db: Database) -> dict[State, int]:
    found: dict[State, int] = {}
    for row in db.tasks.values():
        if not row.task.state.terminal:
            found[row.task.state] = found.get(row.task.state, 0) + 1
    return found


def organization_counts(db: Database) -> dict[str, int]:
    found: dict[str, int] = {}
    for row in db.tasks.values():
        if not row.task.state.terminal:
            found[row.task.organization] = found.get(row.task.organization, 0) + 1
    return found


def request_cancel(db: Database, task_id: str, *, now: float) -> CancelAnswer:
    row = _row(db, task_id)
    answer = cancel(row, now)
    if answer.moved:  # a queued task ended at once: a step's scan moves on
        scans.step_ended(db, row, now)
    scans.flush(db)
    return answer


def retry(db: Database, task_id: str, *, now: float, max_queued: int | None) -> Task:
    row = _row(db, task_id)
    state = rules.retry_step(row.task.state)
    if row.scan is not None:
        raise Conflict(rules.step_retry_refused(task_id, row.scan[0], row.scan[1]))
    check_room(db, 1, max_queued)
    # A new budget: attempt counts from zero again; attempts[].number keeps counting every row.
    row.update(state=state, attempt=0, interruptions=0, available_at=now, updated_at=now,
               finished_at=None, error=None, progress=None)
    return dataclasses.replace(row.task, attempts=tuple(row.attempts))


def _row(db: Database, task_id: str) -> TaskRow:
    try:
        return db.tasks[task_id]
    except KeyError:
        raise TaskNotFound(task_id) from None


def _existing(db: Database, new: NewTask) -> Task | None:
    if not new.idempotency_key or new.idempotency_key not in db.task_keys:
        return None
    row = db.tasks[db.task_keys[new.idempotency_key]]
    if row.fingerprint != new.fingerprint():
        raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another body")
    return row.task
