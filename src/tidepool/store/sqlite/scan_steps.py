"""A scan's moves inside the SQLite transactions that end its steps' tasks, on the writer thread.

A step's task that ends for good moves its scan on in the same transaction: its job's end, what it learned
merged into the scan's scope, the next job's task (or the scan's end). Only step tasks come here: the
statements that end any task read its scan_id, and a task without one goes on as before.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

from ...model import AttemptStatus, Outcome, State, canonical_json, new_id
from ...scans import JobState, ScopeRefused, job_state_of, merge_scope
from .. import sql
from ..rows import loads
from ..scan_rows import Stored, Writes, writes
from .writer import Batch

QS = sql.queries(__package__, "scans.sql")  # the scans' statements, by name


def checked(conn: sqlite3.Connection, scan_id: str, outcome: Outcome) -> Outcome:
    """A step's success, or the failure it becomes when what it learned would not fit its scan's scope."""
    row = conn.execute(QS["scan_scope"], (scan_id,)).fetchone()
    try:
        merge_scope(loads(row[0]) if row else {}, outcome.scope)
    except ScopeRefused as exc:
        return replace(outcome, status=AttemptStatus.FAILED, error=exc.error)
    return outcome


def stored(conn: sqlite3.Connection, scan_id: str) -> Stored | None:
    row = conn.execute(QS["scan"], (scan_id,)).fetchone()
    if row is None:
        return None
    return Stored(row, conn.execute(QS["jobs"].format(marks="?"), (scan_id,)).fetchall())


def step_ended(conn: sqlite3.Connection, batch: Batch, *, scan_id: str, index: int, task_id: str, state: State,
               learned: dict[str, object] | None, now: float) -> None:
    """Job `index`'s task `task_id` ended as `state`: move its scan on, unless that task is not the job's live
    one any more (nothing of the scan moves for a stale task)."""
    scan = stored(conn, scan_id)
    if scan is None or not scan.is_current(index, task_id):
        return
    apply(conn, batch, scan, writes(scan, now=now, ended=(index, job_state_of(state)), learned=learned), now)


def advance(conn: sqlite3.Connection, batch: Batch, scan: Stored, now: float) -> None:
    """Whatever a running scan with no live task calls for: the end of its started job applied (its task
    ended unapplied: what it learned is not known), its next job's task, or its end."""
    index = scan.started()
    if index is None:
        apply(conn, batch, scan, writes(scan, now=now), now)
        return
    job = scan.jobs[index]
    if job[7] is not None and not State(job[7]).terminal:
        return  # its task is live (retried meanwhile, or read before it was made): its own end moves the scan
    ended = JobState.FAILED if job[7] is None else job_state_of(State(job[7]))  # gone: pruned under it
    apply(conn, batch, scan, writes(scan, now=now, ended=(index, ended)), now)


def apply(conn: sqlite3.Connection, batch: Batch, scan: Stored, w: Writes, now: float) -> None:
    for index, state in w.jobs:
        conn.execute(QS["set_job"], (state.value, scan.id, index))
    move = w.move
    if w.start is not None:
        index, task, scope_before, retry = w.start
        task_id = new_id(now)
        conn.execute(QS["insert_step"], (
            task_id, task.type, canonical_json(task.payload), task.priority, task.max_attempts, task.timeout_s,
            json.dumps(sorted(task.required_tags)), now, now, now, task.organization, scan.id, index, retry))
        conn.execute(QS["start_job"], (task_id, scope_before, scan.id, index))
        if batch.queued is not None:
            batch.queued += 1
        if move is not None:
            move = replace(move, task_id=task_id)
    conn.execute(QS["move_scan"], (w.state.value, w.scope, now, w.finished_at, scan.id))
    if move is not None:
        batch.moves.append(move)
