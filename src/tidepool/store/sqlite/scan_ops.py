"""The SQLite store's scan verbs: submits, reads, cancels, job retries and the reconciler's pass.

Writes run on the writer thread like every other op; reads on the reader connection. The moves of a
scan inside a task's end are scan_steps.py's.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from typing import Any

from ...errors import Conflict, InvalidRequest, ScanNotFound
from ...model import State, new_id
from ...scans import JobState, NewScan, Scan, ScanState, retry_from
from ..port import ScanCancel, ScanMove, ScanPage
from ..rows import Stored, job_values, scan_of, scan_values, writes
from ..rules import check_room
from . import queue_ops, scan_steps
from .scan_steps import QS
from .writer import Batch

# producers


def add_scan(conn: sqlite3.Connection, batch: Batch, *, new: NewScan, now: float,
             max_queued: int | None) -> tuple[Scan, bool]:
    """The scan and its first job's task, in this op's transaction."""
    if new.idempotency_key:
        found = conn.execute(QS["scan_by_key"], (new.idempotency_key,)).fetchone()
        if found is not None:
            if found[1] != new.fingerprint():
                raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another scan body")
            return read(conn, found[0]), False
    if max_queued is not None:
        check_room(batch.queued_count(conn), 1, max_queued)
    scan_id = new_id(now)
    conn.execute(QS["insert_scan"], scan_values(scan_id, new, now))
    conn.executemany(QS["insert_job"], job_values(scan_id, new))
    _start(conn, batch, scan_id, now)
    return read(conn, scan_id), True


def retry_job(conn: sqlite3.Connection, batch: Batch, *, scan_id: str, index: int, now: float,
              max_queued: int | None) -> Scan:
    scan = _stored(conn, scan_id)
    try:
        states = retry_from(scan_of(scan.row, scan.jobs), index)
    except IndexError:
        raise InvalidRequest("index", f"scan {scan_id} has jobs 0 to {len(scan.jobs) - 1}") from None
    except ValueError as exc:
        raise Conflict(str(exc)) from None
    if max_queued is not None:
        check_room(batch.queued_count(conn), 1, max_queued)
    for i, state in enumerate(states):
        conn.execute(QS["set_job"], (JobState.WAITING.value if i >= index else state.value, scan_id, i))
    conn.execute(QS["retry_scan"], (scan.jobs[index][6], now, scan_id))
    _start(conn, batch, scan_id, now)
    return read(conn, scan_id)


def _start(conn: sqlite3.Connection, batch: Batch, scan_id: str, now: float) -> None:
    """Start the first waiting job of a running scan that has none started; the caller answers with the scan,
    so the move is not told to the listener."""
    told = len(batch.moves)
    scan_steps.apply(conn, batch, _stored(conn, scan_id), writes(_stored(conn, scan_id), now=now), now)
    del batch.moves[told:]


# cancels


def cancel_scan(conn: sqlite3.Connection, batch: Batch, *, scan_id: str, now: float) -> ScanCancel:
    scan = _stored(conn, scan_id)
    state, requested = ScanState(scan.row[2]), scan.row[12] is not None
    if state is ScanState.CANCELLED or (state is ScanState.RUNNING and requested):
        return ScanCancel(state, False)
    if state.ended:
        raise Conflict(f"scan {scan_id} is {state.value}; only a running scan can be cancelled")
    conn.execute(QS["cancel_scan"], (now, now, scan_id))
    index = scan.started()
    task_id = None if index is None else scan.jobs[index][4]
    answer = None
    task_state = None if index is None or scan.jobs[index][7] is None else State(scan.jobs[index][7])
    if task_id is not None and task_state is not None and not task_state.terminal:
        answer = queue_ops.request_cancel(conn, batch, task_id=task_id, now=now)  # ends the scan if it ended now
    scan = _stored(conn, scan_id)
    if scan.running:
        if answer is None or answer.state.terminal:  # no live task: nothing to wait for
            scan_steps.advance(conn, batch, scan, now)
        else:  # its task is stopping: the scan ends when it has, and nothing waits behind it any more
            for i, job in enumerate(scan.jobs):
                if job[3] == JobState.WAITING:
                    conn.execute(QS["set_job"], (JobState.SKIPPED.value, scan_id, i))
    return ScanCancel(ScanState(_stored(conn, scan_id).row[2]), True, task_id, answer)


# the reconciler


def stalled(conn: sqlite3.Connection) -> list[str]:
    """The running scans without a live task, found on the reader: the writer is not held while each running
    scan is looked at."""
    return [r[0] for r in conn.execute(QS["stalled_scans"])]


def advance_scans(conn: sqlite3.Connection, batch: Batch, *, scan_ids: list[str], now: float) -> list[ScanMove]:
    """Move on the scans `stalled` found, each as it stands now."""
    told = len(batch.moves)
    for scan_id in scan_ids:
        scan = scan_steps.stored(conn, scan_id)
        if scan is not None and scan.running:
            scan_steps.advance(conn, batch, scan, now)
    return batch.moves[told:]


# reads (on the reader connection, or inside a write)


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


def read(conn: sqlite3.Connection, scan_id: str) -> Scan:
    with one_snapshot(conn):
        scan = _stored(conn, scan_id)
    return scan_of(scan.row, scan.jobs)


def list_scans(conn: sqlite3.Connection, *, state: ScanState | None, profile: str | None, limit: int,
               cursor: str | None) -> ScanPage:
    with one_snapshot(conn):
        return _page(conn, state=state, profile=profile, limit=limit, cursor=cursor)


def _page(conn: sqlite3.Connection, *, state: ScanState | None, profile: str | None, limit: int,
          cursor: str | None) -> ScanPage:
    where, args = ["1 = 1"], []
    if state is ScanState.PENDING:
        where.append(f"s.state = 'running' AND {QS['first_job_queued']}")
    elif state is ScanState.RUNNING:
        where.append(f"s.state = 'running' AND NOT {QS['first_job_queued']}")
    elif state is not None:
        where.append("s.state = ?")
        args.append(state.value)
    for condition, value in (("s.profile = ?", profile), ("s.id < ?", cursor)):
        if value is not None:
            where.append(condition)
            args.append(value)
    rows = conn.execute(QS["list_scans"].format(where=" AND ".join(where)), (*args, limit + 1)).fetchall()
    jobs = _jobs(conn, [r[0] for r in rows[:limit]])
    scans = [scan_of(r, jobs.get(r[0], [])) for r in rows[:limit]]
    return ScanPage(scans, scans[-1].id if len(rows) > limit else None)


def _stored(conn: sqlite3.Connection, scan_id: str) -> Stored:
    scan = scan_steps.stored(conn, scan_id)
    if scan is None:
        raise ScanNotFound(scan_id)
    return scan


def _jobs(conn: sqlite3.Connection, scan_ids: list[str]) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for chunk in (scan_ids[i:i + 500] for i in range(0, len(scan_ids), 500)):
        for row in conn.execute(QS["jobs"].format(marks=",".join("?" * len(chunk))), chunk):
            found.setdefault(row[0], []).append(row)
    return found
