"""The scans: their verbs, and a scan's moves inside the transactions that end its steps' tasks.

Every transaction that moves a scan holds its row (FOR UPDATE), taken after the row of the task it moves
with, so a step's end, a cancel and the reconciler of several nodes queue behind each other. A step's next
task is inserted and notified in the transaction that ended the step before it. The bare step successes of
a grouped finish end together (succeeded): a few statements for the lot, whatever their number.
finish_cancels and fail_unserviceable leave their steps' scans to advance_scans, which the reconciler runs
right after them.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import asyncpg  # type: ignore[import-untyped, unused-ignore]  # typed when asyncpg-stubs is installed

from ...errors import Conflict, InvalidRequest, ScanNotFound, StoreUnavailable
from ...model import AttemptStatus, Lease, Outcome, State, canonical_json, new_id
from ...scans import JobState, NewScan, Scan, ScanState, ScopeRefused, job_state_of, merge_scope, retry_from
from .. import sql
from ..port import ScanCancel, ScanMove, ScanPage
from ..rows import SCAN_COLUMNS, Stored, Writes, job_values, loads, scan_of, scan_values, writes
from ..rules import progress_text, step_inputs
from . import tasks
from .database import DRIVER_ERRORS, Conn, Database

SQL = sql.queries(__package__, "scans.sql")
Moves = list[ScanMove]
LOCK_TRIES = 5  # a cancel's tries at locking the live task of a scan that keeps moving on
ONE_SNAPSHOT: dict[str, Any] = {"isolation": "repeatable_read", "readonly": True}  # scans and jobs as of one time
SWEEP = 500  # scans moved on per reconciler transaction: bounded locks per step
STEPS_CHUNK = 256  # step successes ended together per transaction: bounded locks, as a grouped completion's
SCAN_WIDTH = len(SCAN_COLUMNS.split(", "))
SHOWN = 5  # attempt ids a warning names: a chunk's 256 would flood the log
Success = tuple[Lease, float, Outcome]  # a bare success: its lease, its end time, how it ended
# a step's end as planned: its attempt and task ids, how it ended, its scan, the scan's move, its end time, and the
# next step's inputs
Planned = tuple[str, str, Outcome, Stored, Writes, float, dict[str, str]]
log = logging.getLogger("tidepool.store.postgres")


class Told:
    """The listener of the scans' moves, told once each transaction that made them has committed."""

    def __init__(self) -> None:
        self.listener: Callable[[Sequence[ScanMove]], None] | None = None

    def __call__(self, moves: Moves) -> None:
        if moves and self.listener is not None:
            self.listener(list(moves))


# the verbs, each a transaction of its own


async def add_scan(db: Database, new: NewScan, *, now: float, max_queued: int | None) -> tuple[Scan, bool]:
    async with db.conn() as conn, conn.transaction():
        return await insert(conn, new, now, max_queued)


async def get_scan(db: Database, scan_id: str) -> Scan:
    async with db.conn() as conn, conn.transaction(**ONE_SNAPSHOT):
        return await _read(conn, scan_id)


async def list_scans(db: Database, *, state: ScanState | None, profile: str | None, limit: int,
                     cursor: str | None) -> ScanPage:
    where, args = ["true"], []
    if state is ScanState.PENDING:
        where.append(f"s.state = 'running' AND {SQL['first_job_queued']}")
    elif state is ScanState.RUNNING:
        where.append(f"s.state = 'running' AND NOT {SQL['first_job_queued']}")
    elif state is not None:
        args.append(state.value)
        where.append(f"s.state = ${len(args)}")
    for condition, value in (("s.profile = ", profile), ("s.id < ", cursor)):
        if value is not None:
            args.append(value)
            where.append(f"{condition}${len(args)}")
    statement = SQL["list_scans"].format(where=" AND ".join(where), limit=f"${len(args) + 1}")
    async with db.conn() as conn, conn.transaction(**ONE_SNAPSHOT):
        rows = await conn.fetch(statement, *args, limit + 1)
        jobs: dict[str, list[Any]] = {}
        for job in await conn.fetch(SQL["jobs"], [r[0] for r in rows[:limit]]):
            jobs.setdefault(job[0], []).append(job)
        scans = await with_files(conn, [scan_of(r, jobs.get(r[0], [])) for r in rows[:limit]])
    return ScanPage(scans, scans[-1].id if len(rows) > limit else None)


async def cancel_scan(db: Database, scan_id: str, *, now: float, cancel: tasks.Cancel, told: Told) -> ScanCancel:
    moves: Moves = []
    async with db.conn() as conn, conn.transaction():
        answer = await _cancel(conn, scan_id, now, moves, cancel)
    told(moves)
    return answer


async def retry_job(db: Database, scan_id: str, index: int, *, now: float, max_queued: int | None) -> Scan:
    async with db.conn() as conn, conn.transaction():
        if max_queued is not None:
            await tasks.check_queue_room(conn, 1, max_queued)
        return await _retry_job(conn, scan_id, index, now)


async def advance_scans(db: Database, *, now: float, told: Told) -> list[ScanMove]:
    moved: list[ScanMove] = []
    while True:
        moves: Moves = []
        async with db.conn(rows=SWEEP) as conn, conn.transaction():
            found = [r[0] for r in await conn.fetch(SQL["stalled_scans"], SWEEP)]
            for scan_id in found:
                scan = await stored(conn, scan_id)
                if scan is not None:
                    await advance(conn, moves, scan, now)
        told(moves)
        moved.extend(moves)
        if len(found) < SWEEP:
            return moved


# inside the verbs' transactions


async def insert(conn: Conn, new: NewScan, now: float, max_queued: int | None) -> tuple[Scan, bool]:
    """add_scan inside the caller's transaction (a schedule's firing's too): the scan and its first job's task;
    (existing, False) for a key used with the same body."""
    if new.idempotency_key and (existing := await _keyed(conn, new)) is not None:
        return existing, False
    if max_queued is not None:
        await tasks.check_queue_room(conn, 1, max_queued)
    await tasks.hold_inputs(conn, [new.inputs])
    scan_id = new_id(now)
    if await conn.fetchval(SQL["insert_scan"], *scan_values(scan_id, new, now)) is None:
        # a submit of the same key beside this one committed first (the insert waited for it): it is seen now
        if (existing := await _keyed(conn, new)) is None:  # and was pruned in between: rare enough to report
            raise StoreUnavailable(f"idempotency_key {new.idempotency_key!r} changed hands during the submit; retry")
        return existing, False
    await conn.execute(SQL["insert_jobs"], scan_id, [j[2] for j in job_values(scan_id, new)])
    if new.inputs:
        await conn.execute(SQL["insert_scan_inputs"], scan_id, list(new.inputs), list(new.inputs.values()))
    await _start(conn, scan_id, now)
    return await _read(conn, scan_id), True


async def _keyed(conn: Conn, new: NewScan) -> Scan | None:
    """The scan that holds new's idempotency key; Conflict when it was submitted with another body."""
    found = await conn.fetchrow(SQL["scan_by_key"], new.idempotency_key)
    if found is None:
        return None
    if found[1] != new.fingerprint():
        raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another scan body")
    return await _read(conn, found[0])


async def _retry_job(conn: Conn, scan_id: str, index: int, now: float) -> Scan:
    scan = await _stored(conn, scan_id)
    try:
        states = retry_from(scan_of(scan.row, scan.jobs), index)
    except IndexError:
        raise InvalidRequest("index", f"scan {scan_id} has jobs 0 to {len(scan.jobs) - 1}") from None
    except ValueError as exc:
        raise Conflict(str(exc)) from None
    for i, state in enumerate(states):
        await conn.execute(SQL["set_job"], JobState.WAITING.value if i >= index else state.value, scan_id, i)
    await conn.execute(SQL["retry_scan"], scan.jobs[index][6], now, scan_id)
    await _start(conn, scan_id, now)
    return await _read(conn, scan_id)


async def _start(conn: Conn, scan_id: str, now: float) -> None:
    """Start the first waiting job of a running scan none of whose jobs is started; the caller answers with
    the scan, so its move is not told."""
    scan = await _stored(conn, scan_id)
    await apply(conn, [], scan, writes(scan, now=now), now)


async def _cancel(conn: Conn, scan_id: str, now: float, moves: Moves, cancel: tasks.Cancel) -> ScanCancel:
    """cancel_scan's transaction. The started job's task is locked before the scan's row, as its end does."""
    task_id, task, scan = await _lock_live(conn, scan_id)
    state = ScanState(scan.row[2])
    if state is ScanState.CANCELLED or (state is ScanState.RUNNING and scan.row[12] is not None):
        return ScanCancel(state, False)
    if state.ended:
        raise Conflict(f"scan {scan_id} is {state.value}; only a running scan can be cancelled")
    await conn.execute(SQL["cancel_scan"], now, scan_id)
    answer = None
    if task_id is not None and task is not None and not State(task[0]).terminal:
        answer = await cancel(conn, task, task_id, now, moves)  # a queued task ends now, the scan with it
    scan = await _stored(conn, scan_id)
    if scan.running:
        if answer is None or answer.state.terminal:  # no live task: nothing to wait for
            await advance(conn, moves, scan, now)
        else:  # its task is stopping: the scan ends when it has, and nothing waits behind it any more
            for i, job in enumerate(scan.jobs):
                if job[3] == JobState.WAITING:
                    await conn.execute(SQL["set_job"], JobState.SKIPPED.value, scan.id, i)
    return ScanCancel(ScanState((await conn.fetchrow(SQL["scan"], scan_id))[2]), True, task_id, answer)


class _MovedOn(Exception):
    """The scan's live task changed between reading it and locking it."""


async def _lock_live(conn: Conn, scan_id: str) -> tuple[str | None, Any, Stored]:
    """The scan's live task (id and locked row, None when it has none) and the scan, both locked in that order.
    The live task is read before it is locked, so a step that ends (or a reconciler that starts the next job)
    in between leaves another one live: the locks are given back (a savepoint rolled back) and taken again on
    the new one, never the task's after the scan's, which would deadlock with a step's end."""
    for _ in range(LOCK_TRIES - 1):
        try:
            async with conn.transaction():
                found = await _locked_live(conn, scan_id)
                if _live_task(found[2]) != found[0]:
                    raise _MovedOn
                return found
        except _MovedOn:
            continue
    found = await _locked_live(conn, scan_id)
    if _live_task(found[2]) != found[0]:  # a scan moving on this fast is not an ordinary race any more
        raise StoreUnavailable(f"scan {scan_id} moved on {LOCK_TRIES} times while it was being cancelled; "
                               "cancel it again")
    return found


async def _locked_live(conn: Conn, scan_id: str) -> tuple[str | None, Any, Stored]:
    unlocked = await stored(conn, scan_id, lock=False)
    if unlocked is None:
        raise ScanNotFound(scan_id)
    task_id = _live_task(unlocked)
    task = None if task_id is None else await tasks.locked_task(conn, task_id)
    return task_id, task, await _stored(conn, scan_id)


def _live_task(scan: Stored) -> str | None:
    index = scan.started()
    return None if index is None else str(scan.jobs[index][4])


async def _read(conn: Conn, scan_id: str) -> Scan:
    scan = await stored(conn, scan_id, lock=False)
    if scan is None:
        raise ScanNotFound(scan_id)
    return (await with_files(conn, [scan_of(scan.row, scan.jobs)]))[0]


async def with_files(conn: Conn, scans: list[Scan]) -> list[Scan]:
    """The scans with their inputs and their jobs' artifacts (each job's latest task's, name -> sha256)."""
    ids = [s.id for s in scans]
    inputs: dict[str, dict[str, str]] = {}
    artifacts: dict[tuple[str, int], dict[str, str]] = {}
    for scan_id, name, sha in await conn.fetch(SQL["scan_inputs"], ids):
        inputs.setdefault(scan_id, {})[name] = sha
    for scan_id, index, name, sha in await conn.fetch(SQL["job_artifacts"], ids):
        artifacts.setdefault((scan_id, index), {})[name] = sha
    return [replace(s, inputs=inputs.get(s.id, {}),
                    jobs=tuple(replace(j, artifacts=artifacts.get((s.id, j.index), {})) for j in s.jobs))
            for s in scans]


async def inputs_of_step(conn: Conn, scan: Stored, index: int) -> dict[str, str]:
    """Job `index`'s task's inputs: the scan's, then the artifacts of each job before it, in job order."""
    shown = (await with_files(conn, [scan_of(scan.row, scan.jobs)]))[0]
    return step_inputs(shown.inputs, [j.artifacts.items() for j in shown.jobs[:index]])


async def _stored(conn: Conn, scan_id: str) -> Stored:
    scan = await stored(conn, scan_id)
    if scan is None:
        raise ScanNotFound(scan_id)
    return scan


async def key_used(conn: Conn, key: str) -> bool:
    """Whether a scan holds this idempotency key (a scan's keys are its own, not its tasks')."""
    return await conn.fetchrow(SQL["scan_by_key"], key) is not None


async def running(conn: Conn, scan_id: str) -> bool:
    """Whether the scan is there and has not ended."""
    row = await conn.fetchrow(SQL["scan"], scan_id)
    return row is not None and not ScanState(row[2]).ended


# a scan's moves, inside the transactions that end its steps' tasks


async def checked(conn: Conn, scan_id: str, outcome: Outcome) -> Outcome:
    """A step's success, or the failure it becomes when what it learned would not fit its scan's scope."""
    scope = await conn.fetchval(SQL["scan_scope"], scan_id)
    try:
        merge_scope(loads(scope) if scope is not None else {}, outcome.scope)
    except ScopeRefused as exc:
        return replace(outcome, status=AttemptStatus.FAILED, error=exc.error)
    return outcome


async def succeeded(conn: Conn, told: Told, ends: Sequence[Success]) -> set[str]:
    """Bare successes the plain grouped completion refused: the scan steps among them ended and their scans
    moved on together, two statements for the lot in a transaction per chunk (a task outside scans or a lost
    lease is left as it is); the attempt ids done. One that is not plain (a scope its scan refuses, a task that
    is not its job's live one, two of one scan, a scan gone) is left too, for the one-by-one way, which says
    why."""
    done: set[str] = set()
    for i in range(0, len(ends), STEPS_CHUNK):
        done |= await _succeeded(conn, told, ends[i:i + STEPS_CHUNK])
    return done


async def _succeeded(conn: Conn, told: Told, ends: Sequence[Success]) -> set[str]:
    moves: Moves = []
    await conn.execute(SQL["begin_steps"])
    try:
        done = await _move_all(conn, moves, ends)
    except Exception as exc:
        if isinstance(exc, DRIVER_ERRORS) and not isinstance(exc, asyncpg.PostgresError):
            raise  # the connection is lost: whether anything landed is for the callers' own paths to find out
        await conn.execute("ROLLBACK")
        # the server refused a statement (a deadlock, say), or a bug: each ends on its own, and a bug here
        # would otherwise send every round the slow way unseen
        shown = [lease.attempt_id for lease, _, _ in ends[:SHOWN]]
        log.warning("%d bare successes (attempts %s%s) did not end together as scan steps: each ends on its "
                    "own", len(ends), ", ".join(shown), ", ..." if len(ends) > SHOWN else "", exc_info=exc)
        return set()
    await conn.execute("COMMIT")
    told(moves)
    return done


async def _move_all(conn: Conn, moves: Moves, ends: Sequence[Success]) -> set[str]:
    """The steps among `ends` locked with their scans, the plain ones planned, their writes sent as one
    statement; the attempt ids written. The others keep their task rows locked until this transaction ends,
    unchanged."""
    by_attempt = {lease.attempt_id: (lease, now, outcome) for lease, now, outcome in ends}
    rows = await conn.fetch(SQL["lock_steps"], [lease.task_id for lease, _, _ in ends],
                            [lease.attempt_id for lease, _, _ in ends], [lease.token for lease, _, _ in ends],
                            [now for _, now, _ in ends])
    per_scan = Counter(row[3] for row in rows)
    planned: list[Planned] = []
    for row in rows:
        attempt_id, task_id, index, scan_id = row[0], row[1], row[2], row[3]
        if scan_id is None or per_scan[scan_id] > 1:
            continue
        scan = Stored(row[3:3 + SCAN_WIDTH], row[3 + SCAN_WIDTH])
        _, now, outcome = by_attempt[attempt_id]
        if not scan.is_current(index, task_id):
            continue
        try:
            w = writes(scan, now=now, ended=(index, JobState.SUCCESS), learned=outcome.scope)
        except ScopeRefused:
            continue
        inputs = {} if w.start is None else _step_inputs(row[4 + SCAN_WIDTH], row[5 + SCAN_WIDTH], w.start[0])
        planned.append((attempt_id, task_id, outcome, scan, w, now, inputs))
    if planned:
        await _write_all(conn, moves, planned)
    return {p[0] for p in planned}


def _step_inputs(scan_inputs: Sequence[Any], artifacts: Sequence[Any], index: int) -> dict[str, str]:
    """Job `index`'s task's inputs from lock_steps' arrays: the scan's, then the artifacts of each job before
    it, in job order."""
    by_job: dict[int, list[tuple[str, str]]] = {}
    for job, name, sha in artifacts:
        by_job.setdefault(job, []).append((name, sha))
    return step_inputs(dict(scan_inputs), [by_job.get(i, []) for i in range(index)])


async def _write_all(conn: Conn, moves: Moves, planned: Sequence[Planned]) -> None:
    """steps_succeeded's arrays, one element per row each kind writes."""
    ends: list[tuple[Any, ...]] = []
    jobs: list[tuple[Any, ...]] = []
    steps: list[tuple[Any, ...]] = []
    files: list[tuple[str, str, str]] = []
    scans: list[tuple[Any, ...]] = []
    for attempt_id, task_id, outcome, scan, w, now, inputs in planned:
        ends.append((task_id, attempt_id, now, progress_text(outcome.progress)))
        jobs += [(scan.id, index, state.value, None, None) for index, state in w.jobs]
        move = w.move
        if w.start is not None:
            index, task, scope_before, retry = w.start
            step_id = new_id(now)
            steps.append((step_id, task.type, canonical_json(task.payload), task.priority, task.max_attempts,
                          task.timeout_s, json.dumps(sorted(task.required_tags)), now, task.organization, scan.id,
                          index, retry, json.dumps(inputs)))
            files += [(step_id, name, sha) for name, sha in inputs.items()]
            jobs.append((scan.id, index, JobState.STARTED.value, step_id, scope_before))
            if move is not None:
                move = replace(move, task_id=step_id)
        scans.append((scan.id, w.state.value, w.scope, now, w.finished_at))
        if move is not None:
            moves.append(move)
    await conn.execute(SQL["steps_succeeded"], *_columns(ends, 4), *_columns(jobs, 5), *_columns(steps, 13),
                       *_columns(files, 3), *_columns(scans, 5))


def _columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """Rows as the parallel arrays unnest() takes: one list per column, empty ones when there are no rows."""
    return [list(column) for column in zip(*rows, strict=True)] if rows else [[] for _ in range(width)]


async def stored(conn: Conn, scan_id: str, *, lock: bool = True) -> Stored | None:
    row = await conn.fetchrow(SQL["lock_scan" if lock else "scan"], scan_id)
    if row is None:
        return None
    return Stored(row, await conn.fetch(SQL["jobs"], [scan_id]))


async def step_ended(conn: Conn, moves: Moves, *, scan_id: str, index: int, task_id: str, state: State,
                     learned: dict[str, Any] | None, now: float) -> None:
    """Job `index`'s task ended as `state` (its row locked by the caller): move its scan on, unless that
    task is not the job's live one any more."""
    scan = await stored(conn, scan_id)
    if scan is None or not scan.is_current(index, task_id):
        return
    await apply(conn, moves, scan, writes(scan, now=now, ended=(index, job_state_of(state)), learned=learned), now)


async def advance(conn: Conn, moves: Moves, scan: Stored, now: float) -> None:
    """A running scan with no live task (its row locked): apply its started job's end (what that task
    learned is not known), start its next job, or end it."""
    index = scan.started()
    if index is None:
        await apply(conn, moves, scan, writes(scan, now=now), now)
        return
    job = scan.jobs[index]
    if job[7] is not None and not State(job[7]).terminal:
        return  # its task is live (retried meanwhile, or read before it was made): its own end moves the scan
    ended = JobState.FAILED if job[7] is None else job_state_of(State(job[7]))  # gone: pruned under it
    await apply(conn, moves, scan, writes(scan, now=now, ended=(index, ended)), now)


async def apply(conn: Conn, moves: Moves, scan: Stored, w: Writes, now: float) -> None:
    for index, state in w.jobs:
        await conn.execute(SQL["set_job"], state.value, scan.id, index)
    move = w.move
    if w.start is not None:
        index, task, scope_before, retry = w.start
        task_id = new_id(now)
        inputs = await inputs_of_step(conn, scan, index)
        await conn.execute(SQL["insert_step"], task_id, task.type, canonical_json(task.payload), task.priority,
                           task.max_attempts, task.timeout_s, sorted(task.required_tags), now, task.organization,
                           scan.id, index, retry, json.dumps(inputs))
        await tasks.insert_inputs(conn, [(task_id, inputs)])
        await conn.execute(SQL["start_job"], task_id, scope_before, scan.id, index)
        if move is not None:
            move = replace(move, task_id=task_id)
    await conn.execute(SQL["move_scan"], w.state.value, w.scope, now, w.finished_at, scan.id)
    if move is not None:
        moves.append(move)
