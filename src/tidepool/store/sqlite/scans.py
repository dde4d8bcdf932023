"""Scans in the SQLite store: their verbs (submits, reads, cancels, job retries, the reconciler's pass), and a
scan's moves inside the transactions that end its steps' tasks.

A step's task that ends for good moves its scan on in the same transaction: its job's end, what it learned
merged into the scan's scope, the next job's task (or the scan's end). Only step tasks come here: the
statements that end any task read its scan_id, and a task without one goes on as before. The moves are made
on the writer thread by whatever ends a step (leases.py, upkeep.py, a cancel), and gathered in the
transaction's Batch, told to the listener once it commits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from ...errors import Conflict, InvalidRequest, ScanNotFound
from ...model import AttemptStatus, Lease, Outcome, State, canonical_json, new_id
from ...scans import JobState, NewScan, Scan, ScanState, ScopeRefused, job_state_of, merge_scope, retry_from
from .. import sql
from ..port import ScanCancel, ScanMove, ScanPage
from ..rows import Stored, Writes, job_values, loads, scan_of, scan_values, writes
from ..rules import check_room, step_inputs
from . import tasks
from .database import FILE_FAULTS, Batch, chunks, error_code, marks

Q = sql.queries(__package__, "scans.sql")
log = logging.getLogger("tidepool.store.sqlite")
STEPS_CHUNK = 200  # step endings per statement: 5 parameters each
SHOWN = 5  # attempt ids a warning names: a chunk's 200 would flood the log each round

# producers


def add_scan(conn: sqlite3.Connection, batch: Batch, *, new: NewScan, now: float,
             max_queued: int | None) -> tuple[Scan, bool]:
    """The scan and its first job's task, in this op's transaction."""
    if new.idempotency_key:
        found = conn.execute(Q["scan_by_key"], (new.idempotency_key,)).fetchone()
        if found is not None:
            if found[1] != new.fingerprint():
                raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another scan body")
            return get_scan(conn, found[0]), False
    if max_queued is not None:
        check_room(tasks.queued(conn, batch), 1, max_queued)
    tasks.check_known(conn, list(new.inputs.values()), [new.inputs])
    scan_id = new_id(now)
    conn.execute(Q["insert_scan"], scan_values(scan_id, new, now))
    conn.executemany(Q["insert_job"], job_values(scan_id, new))
    conn.executemany(Q["insert_scan_input"], [(scan_id, name, sha) for name, sha in new.inputs.items()])
    _start(conn, batch, scan_id, now)
    return get_scan(conn, scan_id), True


# readers (on the reader connection, or inside a write)


def get_scan(conn: sqlite3.Connection, scan_id: str) -> Scan:
    with one_snapshot(conn):
        scan = known(conn, scan_id)
        return with_files(conn, [scan_of(scan.row, scan.jobs)])[0]


def list_scans(conn: sqlite3.Connection, *, state: ScanState | None, profile: str | None, limit: int,
               cursor: str | None) -> ScanPage:
    with one_snapshot(conn):
        return _page(conn, state=state, profile=profile, limit=limit, cursor=cursor)


# cancels and retries


def cancel_scan(conn: sqlite3.Connection, batch: Batch, *, scan_id: str, now: float) -> ScanCancel:
    scan = known(conn, scan_id)
    state, requested = ScanState(scan.row[2]), scan.row[12] is not None
    if state is ScanState.CANCELLED or (state is ScanState.RUNNING and requested):
        return ScanCancel(state, False)
    if state.ended:
        raise Conflict(f"scan {scan_id} is {state.value}; only a running scan can be cancelled")
    conn.execute(Q["cancel_scan"], (now, now, scan_id))
    index = scan.started()
    task_id = None if index is None else scan.jobs[index][4]
    answer = None
    task_state = None if index is None or scan.jobs[index][7] is None else State(scan.jobs[index][7])
    if task_id is not None and task_state is not None and not task_state.terminal:
        # ends the scan if its task ended now
        answer = tasks.request_cancel(conn, batch, task_id=task_id, now=now, step_ended=task_ended)
    scan = known(conn, scan_id)
    if scan.running:
        if answer is None or answer.state.terminal:  # no live task: nothing to wait for
            advance(conn, batch, scan, now)
        else:  # its task is stopping: the scan ends when it has, and nothing waits behind it any more
            for i, job in enumerate(scan.jobs):
                if job[3] == JobState.WAITING:
                    conn.execute(Q["set_job"], (JobState.SKIPPED.value, scan_id, i))
    return ScanCancel(ScanState(known(conn, scan_id).row[2]), True, task_id, answer)


def retry_job(conn: sqlite3.Connection, batch: Batch, *, scan_id: str, index: int, now: float,
              max_queued: int | None) -> Scan:
    scan = known(conn, scan_id)
    try:
        states = retry_from(scan_of(scan.row, scan.jobs), index)
    except IndexError:
        raise InvalidRequest("index", f"scan {scan_id} has jobs 0 to {len(scan.jobs) - 1}") from None
    except ValueError as exc:
        raise Conflict(str(exc)) from None
    if max_queued is not None:
        check_room(tasks.queued(conn, batch), 1, max_queued)
    for i, state in enumerate(states):
        conn.execute(Q["set_job"], (JobState.WAITING.value if i >= index else state.value, scan_id, i))
    conn.execute(Q["retry_scan"], (scan.jobs[index][6], now, scan_id))
    _start(conn, batch, scan_id, now)
    return get_scan(conn, scan_id)


def _start(conn: sqlite3.Connection, batch: Batch, scan_id: str, now: float) -> None:
    """Start the first waiting job of a running scan that has none started; the caller answers with the scan,
    so the move is not told to the listener."""
    told = len(batch.moves)
    apply(conn, batch, known(conn, scan_id), writes(known(conn, scan_id), now=now), now)
    del batch.moves[told:]


# the reconciler


def stalled(conn: sqlite3.Connection) -> list[str]:
    """The running scans without a live task, found on the reader: the writer is not held while each running
    scan is looked at."""
    return [r[0] for r in conn.execute(Q["stalled_scans"])]


def advance_scans(conn: sqlite3.Connection, batch: Batch, *, scan_ids: list[str], now: float) -> list[ScanMove]:
    """Move on the scans `stalled` found, each as it stands now."""
    told = len(batch.moves)
    for scan_id in scan_ids:
        scan = stored(conn, scan_id)
        if scan is not None and scan.running:
            advance(conn, batch, scan, now)
    return batch.moves[told:]


# a scan's moves inside the transactions that end its steps


def checked(conn: sqlite3.Connection, scan_id: str, outcome: Outcome) -> Outcome:
    """A step's success, or the failure it becomes when what it learned would not fit its scan's scope."""
    row = conn.execute(Q["scan_scope"], (scan_id,)).fetchone()
    try:
        merge_scope(loads(row[0]) if row else {}, outcome.scope)
    except ScopeRefused as exc:
        return replace(outcome, status=AttemptStatus.FAILED, error=exc.error)
    return outcome


def succeeded(conn: sqlite3.Connection, batch: Batch, ends: Sequence[tuple[Lease, float, Outcome]]) -> set[str]:
    """Bare successes of one writer round that the plain completion refused: the scan steps among them ended
    and their scans moved on together (a task outside scans or a lost lease is left as it is): one
    statement completes them all, one reads their scans and one their jobs, the writes follow. The attempt ids
    done. Any that is not plain (a scope the scan refuses, a task that is not its job's live one, two of one
    scan) undoes the lot and leaves every one to the one-by-one way, which says why."""
    return set().union(*(_moved(conn, batch, ends[i:i + STEPS_CHUNK]) for i in range(0, len(ends), STEPS_CHUNK)))


def _moved(conn: sqlite3.Connection, batch: Batch, ends: Sequence[tuple[Lease, float, Outcome]]) -> set[str]:
    if not ends:
        return set()
    conn.execute("SAVEPOINT steps")
    moves, queued = len(batch.moves), batch.queued
    try:
        done = _move_all(conn, batch, ends)
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


def _move_all(conn: sqlite3.Connection, batch: Batch,
              ends: Sequence[tuple[Lease, float, Outcome]]) -> set[str] | None:
    by_attempt = {lease.attempt_id: (lease, now, outcome) for lease, now, outcome in ends}
    ended: list[tuple[str, str, int]] = conn.execute(
        Q["complete_steps"].format(rows=",".join([Q["complete_steps_row"]] * len(ends))),
        [x for lease, now, o in ends for x in (lease.task_id, lease.attempt_id, lease.token, now, _progress(o))],
    ).fetchall()
    if not ended:
        return set()
    scans = stored_all(conn, [scan_id for _, scan_id, _ in ended])
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
    conn.execute(Q["attempts_succeeded"].format(rows=",".join([Q["attempts_succeeded_row"]] * len(ended))),
                 [x for attempt_id, _, _ in ended for x in (attempt_id, by_attempt[attempt_id][1])])
    apply_all(conn, batch, planned)
    return {attempt_id for attempt_id, _, _ in ended}


def _progress(outcome: Outcome) -> str | None:
    return None if outcome.progress is None else json.dumps(outcome.progress)


def step_ended(conn: sqlite3.Connection, batch: Batch, *, scan_id: str, index: int, task_id: str, state: State,
               learned: dict[str, object] | None, now: float) -> None:
    """Job `index`'s task `task_id` ended as `state`: move its scan on, unless that task is not the job's live
    one any more (nothing of the scan moves for a stale task)."""
    scan = stored(conn, scan_id)
    if scan is None or not scan.is_current(index, task_id):
        return
    apply(conn, batch, scan, writes(scan, now=now, ended=(index, job_state_of(state)), learned=learned), now)


def task_ended(conn: sqlite3.Connection, batch: Batch, step: Sequence[Any], task_id: str, state: State,
               now: float) -> None:
    """A task a cancel or the reconciler ended for good: if it is a scan's step (`step`: its scan_id,
    scan_index), its scan moves on."""
    if step[0] is not None:
        step_ended(conn, batch, scan_id=step[0], index=step[1], task_id=task_id, state=state, learned=None, now=now)


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
    step_files: list[tuple[str, dict[str, str]]] = []
    for scan, w, now in planned:
        jobs += [(state.value, scan.id, index) for index, state in w.jobs]
        move = w.move
        if w.start is not None:
            index, task, scope_before, retry = w.start
            task_id = new_id(now)
            inputs = inputs_of_step(conn, scan, index)
            steps.append((task_id, task.type, canonical_json(task.payload), task.priority, task.max_attempts,
                          task.timeout_s, json.dumps(sorted(task.required_tags)), now, now, now, task.organization,
                          scan.id, index, retry, json.dumps(inputs)))
            step_files.append((task_id, inputs))
            starts.append((task_id, scope_before, scan.id, index))
            if move is not None:
                move = replace(move, task_id=task_id)
        scans.append((w.state.value, w.scope, now, w.finished_at, scan.id))
        if move is not None:
            batch.moves.append(move)
    conn.executemany(Q["set_job"], jobs)
    conn.executemany(Q["insert_step"], steps)
    tasks.insert_inputs(conn, step_files)
    conn.executemany(Q["start_job"], starts)
    conn.executemany(Q["move_scan"], scans)
    if batch.queued is not None:
        batch.queued += len(steps)


# rows


@contextlib.contextmanager
def one_snapshot(conn: sqlite3.Connection) -> Iterator[None]:
    """A scan's row and its jobs' read as of one time: on the reader (autocommit) a read transaction of their
    own, so a step's end or a prune between the statements cannot tear them; inside a write, that write's."""
    if conn.in_transaction:
        yield
        return
    conn.execute("BEGIN")
    try:
        yield
    finally:
        conn.execute("COMMIT")


def stored(conn: sqlite3.Connection, scan_id: str) -> Stored | None:
    row = conn.execute(Q["scan"], (scan_id,)).fetchone()
    if row is None:
        return None
    return Stored(row, conn.execute(Q["jobs"].format(marks="?"), (scan_id,)).fetchall())


def known(conn: sqlite3.Connection, scan_id: str) -> Stored:
    """The scan as stored; ScanNotFound if there is none."""
    scan = stored(conn, scan_id)
    if scan is None:
        raise ScanNotFound(scan_id)
    return scan


def stored_all(conn: sqlite3.Connection, scan_ids: list[str]) -> dict[str, Stored]:
    """These scans with their jobs, by id: two statements for the lot."""
    ids = marks(len(scan_ids))
    jobs: dict[str, list[Any]] = {}
    for job in conn.execute(Q["jobs"].format(marks=ids), scan_ids):
        jobs.setdefault(job[0], []).append(job)
    scans = conn.execute(Q["scans"].format(marks=ids), scan_ids)
    return {row[0]: Stored(row, jobs.get(row[0], [])) for row in scans}


def _page(conn: sqlite3.Connection, *, state: ScanState | None, profile: str | None, limit: int,
          cursor: str | None) -> ScanPage:
    where, args = ["1 = 1"], []
    if state is ScanState.PENDING:
        where.append(f"s.state = 'running' AND {Q['first_job_queued']}")
    elif state is ScanState.RUNNING:
        where.append(f"s.state = 'running' AND NOT {Q['first_job_queued']}")
    elif state is not None:
        where.append("s.state = ?")
        args.append(state.value)
    for condition, value in (("s.profile = ?", profile), ("s.id < ?", cursor)):
        if value is not None:
            where.append(condition)
            args.append(value)
    rows = conn.execute(Q["list_scans"].format(where=" AND ".join(where)), (*args, limit + 1)).fetchall()
    jobs = _jobs(conn, [r[0] for r in rows[:limit]])
    scans = with_files(conn, [scan_of(r, jobs.get(r[0], [])) for r in rows[:limit]])
    return ScanPage(scans, scans[-1].id if len(rows) > limit else None)


def with_files(conn: sqlite3.Connection, scans: list[Scan]) -> list[Scan]:
    """The scans with their inputs and their jobs' artifacts (each job's latest task's, name -> sha256)."""
    inputs: dict[str, dict[str, str]] = {}
    artifacts: dict[tuple[str, int], dict[str, str]] = {}
    for chunk in chunks([s.id for s in scans]):
        for scan_id, name, sha in conn.execute(Q["scan_inputs"].format(marks=marks(len(chunk))), chunk):
            inputs.setdefault(scan_id, {})[name] = sha
        for scan_id, index, name, sha in conn.execute(Q["job_artifacts"].format(marks=marks(len(chunk))), chunk):
            artifacts.setdefault((scan_id, index), {})[name] = sha
    return [replace(s, inputs=inputs.get(s.id, {}),
                    jobs=tuple(replace(j, artifacts=artifacts.get((s.id, j.index), {})) for j in s.jobs))
            for s in scans]


def inputs_of_step(conn: sqlite3.Connection, scan: Stored, index: int) -> dict[str, str]:
    """Job `index`'s task's inputs: the scan's, then the artifacts of each job before it, in job order."""
    shown = with_files(conn, [scan_of(scan.row, scan.jobs)])[0]
    return step_inputs(shown.inputs, [j.artifacts.items() for j in shown.jobs[:index]])


def _jobs(conn: sqlite3.Connection, scan_ids: list[str]) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for chunk in chunks(scan_ids):
        for row in conn.execute(Q["jobs"].format(marks=marks(len(chunk))), chunk):
            found.setdefault(row[0], []).append(row)
    return found
