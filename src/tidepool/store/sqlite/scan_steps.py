"""A scan's moves inside the SQLite transactions that end its steps' tasks, on the writer thread.

A step's task that ends for good moves its scan on in the same transaction: its job's end, what it learned
merged into the scan's scope, the next job's task (or the scan's end). Only step tasks come here: the
statements that end any task read its scan_id, and a task without one goes on as before.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ...model import AttemptStatus, Lease, Outcome, State, canonical_json, new_id
from ...scans import JobState, ScopeRefused, job_state_of, merge_scope
from .. import sql
from ..rows import Stored, Writes, loads, writes
from .database import Q, error_code
from .writer import FILE_FAULTS, Batch

QS = sql.queries(__package__, "scans.sql")  # the scans' statements, by name
log = logging.getLogger("tidepool.store.sqlite")


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


def succeeded(conn: sqlite3.Connection, batch: Batch, ends: Sequence[tuple[Lease, float, Outcome]]) -> set[str]:
    """Bare successes of one writer round that the plain completion refused: the scan steps among them ended
    and their scans moved on together (a task outside scans or a lost lease is left as it is): one
    statement completes them all, one reads their scans and one their jobs, the writes follow. The attempt ids
    done. Any that is not plain (a scope the scan refuses, a task that is not its job's live one, two of one
    scan) undoes the lot and leaves every one to the one-by-one way, which says why."""
    return set().union(*(moved(conn, batch, ends[i:i + CHUNK]) for i in range(0, len(ends), CHUNK)))


def moved(conn: sqlite3.Connection, batch: Batch, ends: Sequence[tuple[Lease, float, Outcome]]) -> set[str]:
    if not ends:
        return set()
    conn.execute("SAVEPOINT steps")
    moves, queued = len(batch.moves), batch.queued
    try:
        done = move_all(conn, batch, ends)
    except Exception as exc:
        if error_code(exc) in FILE_FAULTS or not conn.in_transaction:
            raise
        # not the file's fault: a bug here would otherwise send every round the slow way unseen
        shown = [lease.attempt_id for lease, _, _ in ends[:SHOWN]]
        log.warning("%d bare successes (attempts %s%s) did not end together as scan steps: each ends on its "
                    "own", len(ends), ", ".join(shown), ", ..." if len(ends) > SHOWN else "", exc_info=exc)
        done = None
    if done is None:
        conn.execute("ROLLBACK TO steps")
        del batch.moves[moves:]
        batch.queued = queued
    conn.execute("RELEASE steps")
    return done or set()


def move_all(conn: sqlite3.Connection, batch: Batch, ends: Sequence[tuple[Lease, float, Outcome]]) -> set[str] | None:
    by_attempt = {lease.attempt_id: (lease, now, outcome) for lease, now, outcome in ends}
    ended: list[tuple[str, str, int]] = conn.execute(
        QS["complete_steps"].format(rows=",".join([QS["complete_steps_row"]] * len(ends))),
        [x for lease, now, o in ends for x in (lease.task_id, lease.attempt_id, lease.token, now, progress(o))],
    ).fetchall()
    if not ended:
        return set()
    scans = read(conn, [scan_id for _, scan_id, _ in ended])
    if len(scans) != len(ended):
        return None  # two of one scan, or a scan gone
    planned = []
    for attempt_id, scan_id, index in ended:
        lease, now, outcome = by_attempt[attempt_id]
        scan = scans[scan_id]
        if not scan.is_current(index, lease.task_id):
            return None
        try:
            planned.append((scan, writes(scan, now=now, ended=(index, JobState.SUCCESS), learned=outcome.scope),
                            now))
        except ScopeRefused:
            return None
    conn.execute(Q["attempts_succeeded"].format(rows=",".join(["(?, ?)"] * len(ended))),
                 [x for attempt_id, _, _ in ended for x in (attempt_id, by_attempt[attempt_id][1])])
    apply_all(conn, batch, planned)
    return {attempt_id for attempt_id, _, _ in ended}


CHUNK = 200  # endings per statement: 5 parameters each
SHOWN = 5  # attempt ids a warning names: a chunk's 200 would flood the log each round


def progress(outcome: Outcome) -> str | None:
    return None if outcome.progress is None else json.dumps(outcome.progress)


def read(conn: sqlite3.Connection, scan_ids: list[str]) -> dict[str, Stored]:
    """These scans with their jobs, by id: two statements for the lot."""
    marks = ",".join("?" * len(scan_ids))
    jobs: dict[str, list[Any]] = {}
    for job in conn.execute(QS["jobs"].format(marks=marks), scan_ids):
        jobs.setdefault(job[0], []).append(job)
    scans = conn.execute(QS["scans"].format(marks=marks), scan_ids)
    return {row[0]: Stored(row, jobs.get(row[0], [])) for row in scans}


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
    apply_all(conn, batch, [(scan, w, now)])


def apply_all(conn: sqlite3.Connection, batch: Batch, planned: Sequence[tuple[Stored, Writes, float]]) -> None:
    """The scans' moves written, each statement run once for the lot (executemany)."""
    jobs, steps, starts, scans = [], [], [], []
    for scan, w, now in planned:
        jobs += [(state.value, scan.id, index) for index, state in w.jobs]
        move = w.move
        if w.start is not None:
            index, task, scope_before, retry = w.start
            task_id = new_id(now)
            steps.append((task_id, task.type, canonical_json(task.payload), task.priority, task.max_attempts,
                          task.timeout_s, json.dumps(sorted(task.required_tags)), now, now, now, task.organization,
                          scan.id, index, retry))
            starts.append((task_id, scope_before, scan.id, index))
            if move is not None:
                move = replace(move, task_id=task_id)
        scans.append((w.state.value, w.scope, now, w.finished_at, scan.id))
        if move is not None:
            batch.moves.append(move)
    conn.executemany(QS["set_job"], jobs)
    conn.executemany(QS["insert_step"], steps)
    conn.executemany(QS["start_job"], starts)
    conn.executemany(QS["move_scan"], scans)
    if batch.queued is not None:
        batch.queued += len(steps)
