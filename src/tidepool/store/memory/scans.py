"""The memory store's scans: scan rows beside the task rows, and a scan's moves inside the calls that end its
tasks (step_ended, told to the listener by flush)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...errors import Conflict, InvalidRequest, ScanNotFound
from ...model import NewTask, State, Task
from ...scans import (
    Job,
    JobState,
    NewScan,
    Plan,
    Scan,
    ScanState,
    job_state_of,
    merge_scope,
    plan,
    retry_from,
    shown,
    shown_scan,
    step_task,
)
from ..port import ScanCancel, ScanListener, ScanMove, ScanPage
from ..rules import check_inputs, step_inputs
from .database import Database, JobRow, ScanRow, TaskRow, cancel, check_room, insert


def add_scan(db: Database, new: NewScan, *, now: float, max_queued: int | None) -> tuple[Scan, bool]:
    if new.idempotency_key and new.idempotency_key in db.scan_keys:
        row = db.scans[db.scan_keys[new.idempotency_key]]
        if row.fingerprint != new.fingerprint():
            raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another scan body")
        return _scan(db, row), False
    check_room(db, 1, max_queued)
    check_inputs(new.inputs, db.blobs)
    row = ScanRow(db.new_id(now), new, new.fingerprint(), [JobRow(s) for s in new.steps], now, now)
    db.scans[row.id] = row
    if new.idempotency_key:
        db.scan_keys[new.idempotency_key] = row.id
    _start(db, row, 0, now)
    return _scan(db, row), True


def get_scan(db: Database, scan_id: str) -> Scan:
    return _scan(db, _row(db, scan_id))


def list_scans(db: Database, *, state: ScanState | None, profile: str | None, limit: int,
               cursor: str | None) -> ScanPage:
    picked = []
    for scan_id in sorted(db.scans, reverse=True):
        if cursor is not None and scan_id >= cursor:
            continue
        scan = _scan(db, db.scans[scan_id])
        if (state is None or scan.state is state) and (profile is None or scan.profile == profile):
            picked.append(scan)
            if len(picked) > limit:
                break
    return ScanPage(picked[:limit], picked[limit - 1].id if len(picked) > limit else None)


def cancel_scan(db: Database, scan_id: str, *, now: float) -> ScanCancel:
    row = _row(db, scan_id)
    if row.state is ScanState.CANCELLED or (row.state is ScanState.RUNNING and row.cancel_requested_at):
        return ScanCancel(row.state, False)
    if row.state.ended:
        raise Conflict(f"scan {scan_id} is {row.state.value}; only a running scan can be cancelled")
    row.cancel_requested_at, row.updated_at = now, now
    index = next((i for i, j in enumerate(row.jobs) if j.state is JobState.STARTED), None)
    task_id = None if index is None else row.jobs[index].task_id
    task = _task(db, task_id)
    answer = None
    if task is not None and not task.state.terminal:
        answer = cancel(db.tasks[task.id], now)  # a queued task ends now, and the scan with it (below)
        task = _task(db, task_id)
    if row.state is ScanState.RUNNING:
        if index is None:
            _advance(db, row, now)
        elif task is None or task.state.terminal:  # its end was not applied yet
            _job_ended(db, row.id, index, task_id, job_state_of(task.state) if task else JobState.FAILED,
                       None, now)
        else:  # its task is stopping: the scan ends when it has, and nothing waits behind it any more
            for job in row.jobs:
                if job.state is JobState.WAITING:
                    job.state = JobState.SKIPPED
    flush(db)
    return ScanCancel(row.state, True, task_id, answer)


def retry_job(db: Database, scan_id: str, index: int, *, now: float, max_queued: int | None) -> Scan:
    row = _row(db, scan_id)
    scan = _scan(db, row)
    try:
        states = retry_from(scan, index)
    except IndexError:
        raise InvalidRequest("index", f"scan {scan_id} has jobs 0 to {len(row.jobs) - 1}") from None
    except ValueError as exc:
        raise Conflict(str(exc)) from None
    check_room(db, 1, max_queued)
    for job, state in zip(row.jobs, states, strict=True):
        job.state = state
    row.state, row.finished_at, row.cancel_requested_at, row.updated_at = ScanState.RUNNING, None, None, now
    row.scope = dict(row.jobs[index].scope_before)
    _start(db, row, index, now)
    return _scan(db, row)


def advance_scans(db: Database, *, now: float) -> list[ScanMove]:
    for row in list(db.scans.values()):
        if row.state is not ScanState.RUNNING:
            continue
        live = next((i for i, j in enumerate(row.jobs) if j.state is JobState.STARTED), None)
        if live is None:
            _advance(db, row, now)
            continue
        task_id = row.jobs[live].task_id
        task = _task(db, task_id)
        if task is None or task.state.terminal:  # ended without its scan being told: learned nothing known
            _job_ended(db, row.id, live, task_id, job_state_of(task.state) if task else JobState.FAILED, {}, now)
    return flush(db)


def on_scan_moves(db: Database, listener: ScanListener | None) -> None:
    db.listener = listener


# a scan's moves inside a task's end

def scope_after(db: Database, scan_id: str, learned: dict[str, Any] | None) -> dict[str, Any]:
    """The scan's scope with what a succeeding step learned (ScopeRefused past the bound)."""
    row = db.scans.get(scan_id)
    return {} if row is None else merge_scope(row.scope, learned)


def step_ended(db: Database, row: TaskRow, now: float, learned: dict[str, Any] | None = None) -> None:
    """A scan step's task that ended for good moves its scan on."""
    if row.scan is not None and row.task.state.terminal:
        _job_ended(db, row.scan[0], row.scan[1], row.task.id, job_state_of(row.task.state), learned, now)


def flush(db: Database) -> list[ScanMove]:
    """The moves made since the last flush, told to the listener."""
    moves, db.moves = db.moves, []
    if moves and db.listener is not None:
        db.listener(moves)
    return moves


def prune(db: Database, *, before: float) -> None:
    for scan_id in [i for i, r in db.scans.items()
                    if r.state.ended and r.finished_at is not None and r.finished_at < before]:
        row = db.scans.pop(scan_id)
        if row.new.idempotency_key:
            db.scan_keys.pop(row.new.idempotency_key, None)


def _job_ended(db: Database, scan_id: str, index: int, task_id: str | None, ended: JobState,
               learned: dict[str, Any] | None, now: float) -> None:
    row = db.scans.get(scan_id)
    if row is None or row.state.ended or row.jobs[index].state is not JobState.STARTED \
            or row.jobs[index].task_id != task_id:
        return  # not this scan's current task (a stale one): nothing of the scan moves
    scope = scope_after(db, scan_id, learned) if ended is JobState.SUCCESS else row.scope
    _apply(db, row, plan([j.state for j in row.jobs], scope=scope, ended=(index, ended),
                         continue_on_failure=row.new.continue_on_failure,
                         cancel_requested=row.cancel_requested_at is not None), now, (index, ended))


def _advance(db: Database, row: ScanRow, now: float) -> None:
    _apply(db, row, plan([j.state for j in row.jobs], scope=row.scope,
                         continue_on_failure=row.new.continue_on_failure,
                         cancel_requested=row.cancel_requested_at is not None), now, None)


def _apply(db: Database, row: ScanRow, p: Plan, now: float, ended: tuple[int, JobState] | None) -> None:
    for job, state in zip(row.jobs, p.states, strict=True):
        job.state = state
    row.scope, row.updated_at = p.scope, now
    move = ScanMove(row.id, row.new.profile, *(ended or (None, None)))
    if p.start is not None:
        task = _start(db, row, p.start, now)
        move = dataclasses.replace(move, task_id=task.id, type=task.type, started=p.start)
    if p.finish is not None:
        row.state, row.finished_at = p.finish, now
        move = dataclasses.replace(move, finished=p.finish)
    if move != ScanMove(row.id, row.new.profile):
        db.moves.append(move)


def _start(db: Database, row: ScanRow, index: int, now: float) -> Task:
    job = row.jobs[index]
    job.state, job.scope_before = JobState.STARTED, dict(row.scope)
    new: NewTask = step_task(job.step, payload=row.new.payload, scope=row.scope, priority=row.new.priority,
                             organization=row.new.organization)
    earlier = [_artifacts(db, j.task_id).items() for j in row.jobs[:index]]
    task = insert(db, dataclasses.replace(new, inputs=step_inputs(row.new.inputs, earlier)), now)
    db.tasks[task.id].scan = (row.id, index, job.tasks)
    job.task_id, job.tasks = task.id, job.tasks + 1
    return task


# reads

def _row(db: Database, scan_id: str) -> ScanRow:
    try:
        return db.scans[scan_id]
    except KeyError:
        raise ScanNotFound(scan_id) from None


def _scan(db: Database, row: ScanRow) -> Scan:
    jobs = tuple(_job(db, i, j) for i, j in enumerate(row.jobs))
    return Scan(row.id, row.new.profile, shown_scan(row.state, jobs), row.new.organization, row.new.payload,
                dict(row.scope), row.new.priority, row.new.continue_on_failure, row.new.idempotency_key, jobs,
                row.created_at, row.updated_at, row.finished_at, row.cancel_requested_at, dict(row.new.inputs))


def _task(db: Database, task_id: str | None) -> Task | None:
    """The task, None when it is gone (pruned) or there is none."""
    row = None if task_id is None else db.tasks.get(task_id)
    return None if row is None else row.task


def _job(db: Database, index: int, job: JobRow) -> Job:
    row = None if job.task_id is None else db.tasks.get(job.task_id)
    state: State | None = None if row is None else row.task.state
    # the attempts its task has started, an interrupted one (given back to its count) included
    return Job(index, job.step.type, shown(job.state, state), job.task_id, 0 if row is None else len(row.attempts),
               None if row is None else row.task.error, job.tasks, _artifacts(db, job.task_id))


def _artifacts(db: Database, task_id: str | None) -> dict[str, str]:
    """A job's task's artifacts, name -> sha256: every attempt's, a later attempt's of the same name winning."""
    row = None if task_id is None else db.tasks.get(task_id)
    return {} if row is None else {a.name: a.sha256 for a in row.artifacts}
