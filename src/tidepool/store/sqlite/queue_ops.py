"""The queue's writes, run on the writer thread: submits, cancels, retries, schedules, the reconciler's passes,
the node registry.

`Batch.queued` counts the queue once per transaction for the max_queued checks; an op that grows or
shrinks the queue keeps it up to date, or drops it to be counted again.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from ... import schedules
from ...errors import Conflict, ScheduleNotFound, TaskNotFound
from ...lifecycle import Event, RetryPolicy, step
from ...model import CANCELLED_ON_REQUEST, Lease, NewTask, State, Task, TaskError, cancel_deadline_error, new_id
from ...scans import NewScan, ScanState
from ...schedules import Fired, Schedule
from ..port import CancelAnswer, Ended, Expired, Node
from ..rows import error_text, node_values, schedule_of, schedule_values
from ..rules import batch_answer, cancel_step, check_room, expiry_outcome, retry_step, step_retry_refused
from . import scan_ops, scan_steps
from .database import Q
from .reads import task_of, task_row, task_with_attempts
from .work import chunks, end, marks
from .writer import Batch

# producers


def add(conn: sqlite3.Connection, batch: Batch, *, new: NewTask, now: float,
        max_queued: int | None) -> tuple[Task, bool]:
    existing = _existing(conn, new)
    if existing is not None:
        return existing, False
    _check_room(conn, batch, 1, max_queued)
    task_id = _insert(conn, [new], now)[0]
    return task_of(task_row(conn, task_id)), True


def add_many(conn: sqlite3.Connection, batch: Batch, *, tasks: Sequence[NewTask], now: float,
             max_queued: int | None) -> list[tuple[str, bool]]:
    keys = [n.idempotency_key for n in tasks if n.idempotency_key]
    if len(keys) != len(set(keys)):
        raise Conflict("idempotency_key repeats within the batch")
    existing = _existing_ids(conn, tasks) if keys else {}
    fresh = [n for n in tasks if n.idempotency_key not in existing]
    if fresh:  # a batch sent again whole is answered even when the queue is full, as a single submit
        _check_room(conn, batch, len(fresh), max_queued)
    return batch_answer(tasks, existing, _insert(conn, fresh, now))


def request_cancel(conn: sqlite3.Connection, batch: Batch, *, task_id: str, now: float) -> CancelAnswer:
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
        _step_ended(conn, batch, row[2:4], task_id, target, now)
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
    _check_room(conn, batch, 1, max_queued)
    conn.execute(Q["retry"], (target, now, now, task_id))
    return task_with_attempts(conn, task_id)


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


def _check_room(conn: sqlite3.Connection, batch: Batch, n: int, max_queued: int | None) -> None:
    if max_queued is None:
        batch.queued = None  # an unchecked insert still grows the queue: recount at the next check
        return
    queued = batch.queued_count(conn)
    check_room(queued, n, max_queued)
    batch.queued = queued + n


def _insert(conn: sqlite3.Connection, batch: Sequence[NewTask], now: float) -> list[str]:
    rows = [(new_id(now), n.type, json.dumps(n.payload), n.priority, n.max_attempts, n.timeout_s,
             json.dumps(sorted(n.required_tags)) if n.required_tags else "[]", n.idempotency_key,
             n.fingerprint(), now, now, n.available_at if n.available_at is not None else now, n.organization)
            for n in batch]
    conn.executemany(Q["insert_task"], rows)
    return [r[0] for r in rows]


# schedules


def save_schedule(conn: sqlite3.Connection, batch: Batch, *, schedule: Schedule, now: float) -> Schedule:
    row = conn.execute(Q["schedule"], (schedule.name,)).fetchone()
    saved = schedules.merge(None if row is None else schedule_of(row), schedule, now)
    conn.execute(Q["save_schedule"], schedule_values(saved))
    return saved


def delete_schedule(conn: sqlite3.Connection, batch: Batch, *, name: str, config_node: str | None) -> None:
    if conn.execute(Q["delete_schedule"], (name, config_node, config_node)).rowcount == 0:
        raise ScheduleNotFound(name)


def pause_schedule(conn: sqlite3.Connection, batch: Batch, *, name: str, paused: bool, now: float) -> Schedule:
    row = conn.execute(Q["schedule"], (name,)).fetchone()
    if row is None:
        raise ScheduleNotFound(name)
    saved = schedules.set_paused(schedule_of(row), paused, now)
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
        outcome, saved = schedules.fire(schedule, now, new_task=new_task,
                                        running=lambda task_id: _unfinished(conn, task_id),
                                        add=lambda new: _add_once(conn, batch, new, now, max_queued))
        conn.execute(Q["save_schedule"], schedule_values(saved))
        fired.extend(outcome)
    if fired:
        batch.queued = None
    return fired


def _unfinished(conn: sqlite3.Connection, started: str) -> bool:
    """Whether the task (or, for a profile schedule, the scan) a schedule started last has not ended."""
    scan = conn.execute(scan_steps.QS["scan"], (started,)).fetchone()
    if scan is not None:
        return not ScanState(scan[2]).ended
    row = conn.execute(Q["task_state"], (started,)).fetchone()
    return row is not None and not State(row[0]).terminal


def _add_once(conn: sqlite3.Connection, batch: Batch, new: NewTask | NewScan, now: float,
              max_queued: int | None) -> str | None:
    """The new task's (or scan's) id, or None when one for this key exists already (a tick fires once);
    QueueFull past max_queued."""
    if isinstance(new, NewScan):
        try:  # a tick's scan exists already, with this body or an earlier one: the tick has fired
            scan, created = scan_ops.add_scan(conn, batch, new=new, now=now, max_queued=max_queued)
        except Conflict:
            return None
        return scan.id if created else None
    if conn.execute(Q["key_used"], (new.idempotency_key,)).fetchone():
        return None
    _check_room(conn, batch, 1, max_queued)
    return _insert(conn, [new], now)[0]


# the reconciler


def expire_leases(conn: sqlite3.Connection, batch: Batch, *, now: float, policy: RetryPolicy, node_id: str | None,
                  keep_instance: str | None, interrupted: frozenset[str]) -> list[Expired]:
    if node_id is None:
        rows = conn.execute(Q["expiring"], (now,)).fetchall()
    else:
        rows = conn.execute(Q["expiring_of_node"], (node_id, keep_instance)).fetchall()
    expired = []
    for row in rows:
        lease = Lease(row[5], row[6], row[7], row[4])
        state = end(conn, lease, expiry_outcome(lease.attempt_id, interrupted), row, now, policy, batch,
                    step=row[9:11])
        expired.append(Expired(lease.task_id, lease.attempt_id, state, row[8]))
    return expired


def promote_due(conn: sqlite3.Connection, batch: Batch, *, now: float) -> int:
    return int(conn.execute(Q["promote_due"], (now, now)).rowcount)


def finish_cancels(conn: sqlite3.Connection, batch: Batch, *, now: float, deadline_s: float) -> list[Ended]:
    rows = conn.execute(Q["cancels_due"], (now - deadline_s,)).fetchall()
    error = error_text(cancel_deadline_error(deadline_s))
    for task_id, attempt_id, _, *scan in rows:
        conn.execute(Q["cancel_attempt"], (now, error, attempt_id))
        conn.execute(Q["cancel_task"], (step(State.CANCELLING, Event.CANCEL_ACK), error, now, now, task_id))
        _step_ended(conn, batch, scan, task_id, State.CANCELLED, now)
    return [Ended(r[0], r[2]) for r in rows]


def prune(conn: sqlite3.Connection, batch: Batch, *, before: float) -> int:
    conn.execute(Q["prune_results"], (before,))
    conn.execute(Q["prune_attempts"], (before,))
    conn.execute(Q["prune_nodes"], (before,))
    conn.execute(scan_steps.QS["prune_jobs"], (before,))
    conn.execute(scan_steps.QS["prune_scans"], (before,))
    return int(conn.execute(Q["prune_tasks"], (before,)).rowcount)


def fail_unserviceable(conn: sqlite3.Connection, batch: Batch, *, tags: frozenset[str], now: float,
                       message: str) -> list[Ended]:
    error = error_text(TaskError("unserviceable", message, retryable=False))
    target = step(State.PENDING, Event.UNSERVICEABLE)  # retry_wait moves the same way
    rows = conn.execute(Q["fail_unserviceable"], (target, error, now, now, json.dumps(sorted(tags)))).fetchall()
    if batch.queued is not None:
        batch.queued -= len(rows)
    for r in rows:
        _step_ended(conn, batch, r[2:4], r[0], target, now)
    return [Ended(r[0], r[1]) for r in rows]


def _step_ended(conn: sqlite3.Connection, batch: Batch, step: Sequence[Any], task_id: str, state: State,
                now: float) -> None:
    """A task these passes ended for good: if it is a scan's step (`step`: its scan_id, scan_index), its scan
    moves on."""
    if step[0] is not None:
        scan_steps.step_ended(conn, batch, scan_id=step[0], index=step[1], task_id=task_id, state=state,
                              learned=None, now=now)


# the fleet


def save_node(conn: sqlite3.Connection, batch: Batch, *, values: tuple[Any, ...]) -> None:
    conn.execute(Q["save_node"], values)


def node_values_of(node: Node) -> tuple[Any, ...]:
    return node_values(node, task_types=json.dumps(list(node.task_types)))
