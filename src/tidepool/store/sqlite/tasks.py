"""The queue's tasks in the SQLite store: submits, reads, cancels and retries, and the room left in the queue.

`Batch.queued` counts the queue once per transaction for the max_queued checks (queued); an op that grows or
shrinks the queue keeps it up to date, or drops it to be counted again. A scan's steps are tasks, and scans.py
is built on this module: a cancel that ends a step at once is told by its caller how that step's scan moves on.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeAlias

from ...errors import Conflict, TaskNotFound
from ...model import CANCELLED_ON_REQUEST, Artifact, Attempt, NewTask, State, Task, new_id
from .. import sql
from ..port import CancelAnswer, Page
from ..rows import artifact_of, attempt_of, error_text, result_of
from ..rules import batch_answer, cancel_step, check_inputs, check_room, retry_step, step_retry_refused
from .database import Batch, chunks, marks, task_of

Q = sql.queries(__package__, "tasks.sql")
# (conn, batch, (scan_id, scan_index), task_id, state, now): a task ended for good moves its scan on, if a step's
StepEnded: TypeAlias = Callable[[sqlite3.Connection, Batch, Sequence[Any], str, State, float], None]

# producers


def add(conn: sqlite3.Connection, batch: Batch, *, new: NewTask, now: float,
        max_queued: int | None) -> tuple[Task, bool]:
    existing = _existing(conn, new)
    if existing is not None:
        return existing, False
    make_room(conn, batch, 1, max_queued)
    task_id = insert(conn, [new], now)[0]
    return task_of(task_row(conn, task_id)), True


def add_many(conn: sqlite3.Connection, batch: Batch, *, tasks: Sequence[NewTask], now: float,
             max_queued: int | None) -> list[tuple[str, bool]]:
    keys = [n.idempotency_key for n in tasks if n.idempotency_key]
    if len(keys) != len(set(keys)):
        raise Conflict("idempotency_key repeats within the batch")
    existing = _existing_ids(conn, tasks) if keys else {}
    fresh = [n for n in tasks if n.idempotency_key not in existing]
    if fresh:  # a batch sent again whole is answered even when the queue is full, as a single submit
        make_room(conn, batch, len(fresh), max_queued)
    return batch_answer(tasks, existing, insert(conn, fresh, now))


# readers (on the reader connection, or inside a write)


def get(conn: sqlite3.Connection, task_id: str) -> Task:
    """The task with its attempts and results."""
    task = task_with_attempts(conn, task_id)
    results = conn.execute(Q["results_of_task"], (task_id,)).fetchall()
    return replace(task, results=tuple(result_of(r) for r in results), artifacts=tuple(artifacts_of(conn, task_id)))


def artifacts_of(conn: sqlite3.Connection, task_id: str) -> list[Artifact]:
    """Every attempt's artifacts, oldest first."""
    return [artifact_of(r) for r in conn.execute(Q["artifacts_of_task"], (task_id,))]


def list_tasks(conn: sqlite3.Connection, *, state: State | None, type: str | None, limit: int,
               cursor: str | None, organization: str | None = None) -> Page:
    where, args = ["1 = 1"], []
    for column, value in (("state", state), ("type", type), ("organization", organization)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(str(value))
    if cursor is not None:
        where.append("id < ?")
        args.append(cursor)
    rows = conn.execute(Q["list_tasks"].format(where=" AND ".join(where)), (*args, limit + 1)).fetchall()
    found = attempts(conn, [r[0] for r in rows[:limit]])
    tasks = [task_of(r, attempts=found.get(r[0], ())) for r in rows[:limit]]
    return Page(tasks, tasks[-1].id if len(rows) > limit else None)


def counts(conn: sqlite3.Connection) -> dict[State, int]:
    return {State(s): n for s, n in conn.execute(Q["counts"])}


def organization_counts(conn: sqlite3.Connection) -> dict[str, int]:
    return dict(conn.execute(Q["organization_counts"]).fetchall())


# cancels and retries


def request_cancel(conn: sqlite3.Connection, batch: Batch, *, task_id: str, now: float,
                   step_ended: StepEnded) -> CancelAnswer:
    """The cancel of one task; `step_ended` (scans.task_ended) moves the scan of a step that ends here."""
    row = conn.execute(Q["task_state"], (task_id,)).fetchone()
    if row is None:
        raise TaskNotFound(task_id)
    current = State(row[0])
    target = cancel_step(current)
    if target is current:
        return CancelAnswer(target, False, row[1])
    if target is State.CANCELLED:
        conn.execute(Q["cancel_queued"], (target, error_text(CANCELLED_ON_REQUEST), now, now, task_id))
        batch.queued = None  # the queue shrank: recount before the next max_queued check
        step_ended(conn, batch, row[2:4], task_id, target, now)
    else:
        conn.execute(Q["cancel_held"], (target, now, now, task_id))
    return CancelAnswer(target, True, row[1])


def retry(conn: sqlite3.Connection, batch: Batch, *, task_id: str, now: float, max_queued: int | None) -> Task:
    row = conn.execute(Q["task_state"], (task_id,)).fetchone()  # (state, type, scan_id, scan_index)
    if row is None:
        raise TaskNotFound(task_id)
    target = retry_step(State(row[0]))
    scan_id, index = row[2], row[3]
    if scan_id is not None:
        raise Conflict(step_retry_refused(task_id, scan_id, index))
    make_room(conn, batch, 1, max_queued)
    conn.execute(Q["retry"], (target, now, now, task_id))
    return task_with_attempts(conn, task_id)


# the queue's room, and new rows (a schedule's ticks queue tasks too)


def queued(conn: sqlite3.Connection, batch: Batch) -> int:
    """The queue's length as this transaction's ops so far left it: counted by the first that asks."""
    if batch.queued is None:
        batch.queued = int(conn.execute(Q["count_queued"]).fetchone()[0])
    return batch.queued


def make_room(conn: sqlite3.Connection, batch: Batch, n: int, max_queued: int | None) -> None:
    """QueueFull unless `n` more tasks fit under max_queued; counted in, as the caller queues them."""
    if max_queued is None:
        batch.queued = None  # an unchecked insert still grows the queue: recount at the next check
        return
    length = queued(conn, batch)
    check_room(length, n, max_queued)
    batch.queued = length + n


def insert(conn: sqlite3.Connection, new: Sequence[NewTask], now: float) -> list[str]:
    """The tasks' rows and their inputs' (InvalidRequest for an input that is no blob: the op inserts nothing)."""
    check_known(conn, [sha for n in new for sha in n.inputs.values()], [n.inputs for n in new])
    rows = [(new_id(now), n.type, json.dumps(n.payload), n.priority, n.max_attempts, n.timeout_s,
             json.dumps(sorted(n.required_tags)) if n.required_tags else "[]", n.idempotency_key,
             n.fingerprint(), now, now, n.available_at if n.available_at is not None else now, n.organization,
             json.dumps(n.inputs))
            for n in new]
    conn.executemany(Q["insert_task"], rows)
    insert_inputs(conn, [(r[0], n.inputs) for r, n in zip(rows, new, strict=True)])
    return [r[0] for r in rows]


def check_known(conn: sqlite3.Connection, sha256s: Sequence[str], inputs: Sequence[Mapping[str, str]]) -> None:
    """InvalidRequest naming the first of `inputs` whose blob the store has not."""
    if not sha256s:
        return
    known = {r[0] for chunk in chunks(sorted(set(sha256s)))
             for r in conn.execute(Q["known_blobs"].format(marks=marks(len(chunk))), chunk)}
    for named in inputs:
        check_inputs(named, known)


def insert_inputs(conn: sqlite3.Connection, inputs: Sequence[tuple[str, Mapping[str, str]]]) -> None:
    """The rows that name each task's input blobs, which the pruning of blobs reads."""
    conn.executemany(Q["insert_input"], [(task_id, name, sha) for task_id, named in inputs
                                          for name, sha in named.items()])


# rows


def task_row(conn: sqlite3.Connection, task_id: str) -> Any:
    row = conn.execute(Q["task"], (task_id,)).fetchone()
    if row is None:
        raise TaskNotFound(task_id)
    return row


def attempts(conn: sqlite3.Connection, task_ids: list[str]) -> dict[str, tuple[Attempt, ...]]:
    if not task_ids:
        return {}
    found: dict[str, list[Attempt]] = {}
    for r in conn.execute(Q["attempts_of_tasks"].format(marks=marks(len(task_ids))), task_ids):
        found.setdefault(r[1], []).append(attempt_of(r))
    return {k: tuple(v) for k, v in found.items()}


def task_with_attempts(conn: sqlite3.Connection, task_id: str) -> Task:
    return task_of(task_row(conn, task_id), attempts=attempts(conn, [task_id]).get(task_id, ()))


def _existing(conn: sqlite3.Connection, new: NewTask) -> Task | None:
    if not new.idempotency_key:
        return None
    row = conn.execute(Q["task_by_key"], (new.idempotency_key,)).fetchone()
    if row is None:
        return None
    if row[-1] != new.fingerprint():
        raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another body")
    return task_of(row[:-1])


def _existing_ids(conn: sqlite3.Connection, batch: Sequence[NewTask]) -> dict[str | None, str]:
    """The tasks the batch's keys already name, by key; Conflict if one was used with another body."""
    found: dict[str | None, str] = {}
    keyed = {n.idempotency_key: n for n in batch if n.idempotency_key}
    for chunk in chunks(list(keyed)):
        for key, task_id, fingerprint in conn.execute(Q["tasks_by_keys"].format(marks=marks(len(chunk))), chunk):
            if fingerprint != keyed[key].fingerprint():
                raise Conflict(f"idempotency_key {key!r} was used with another body")
            found[key] = task_id
    return found
