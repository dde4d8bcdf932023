"""The in-process store's scans: scan rows beside its task rows, moved by the same calls that end their tasks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...errors import Conflict, InvalidRequest, ScanNotFound
from ...model import NewTask, State, Task
from ...scans import (
    Job,
    JobState,
    NewScan,
    Plan,
    Scan,
    ScanState,
    StepSpec,
    job_state_of,
    merge_scope,
    plan,
    retry_from,
    shown,
    shown_scan,
    step_task,
)
from ..port import ScanCancel, ScanListener, ScanMove, ScanPage

if TYPE_CHECKING:
    from . import MemoryStore, _Row


@dataclasses.dataclass
class JobRow:
    step: StepSpec
    state: JobState = JobState.WAITING
    task_id: str | None = None
    tasks: int = 0
    scope_before: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ScanRow:
    id: str
    new: NewScan
    fingerprint: str
    jobs: list[JobRow]
    created_at: float
    updated_at: float
    state: ScanState = ScanState.RUNNING
    scope: dict[str, Any] = dataclasses.field(default_factory=dict)
    finished_at: float | None = None
    cancel_requested_at: float | None = None


class ScanVerbs:
    """The scan verbs of the memory store, on its MemoryScans, and its task rows' side of a scan."""

    _scans: MemoryScans
    _rows: dict[str, _Row]

    if TYPE_CHECKING:
        def _insert(self, new: NewTask, now: float) -> Task: ...

    async def add_scan(self, new: NewScan, *, now: float, max_queued: int | None = None) -> tuple[Scan, bool]:
        return self._scans.add(new, now, max_queued)

    async def get_scan(self, scan_id: str) -> Scan:
        return self._scans.get(scan_id)

    async def list_scans(self, *, state: ScanState | None = None, profile: str | None = None, limit: int = 50,
                         cursor: str | None = None) -> ScanPage:
        return self._scans.page(state, profile, limit, cursor)

    async def cancel_scan(self, scan_id: str, *, now: float) -> ScanCancel:
        return self._scans.cancel(scan_id, now)

    async def retry_job(self, scan_id: str, index: int, *, now: float, max_queued: int | None = None) -> Scan:
        return self._scans.retry(scan_id, index, now, max_queued)

    async def advance_scans(self, *, now: float) -> list[ScanMove]:
        return self._scans.advance_all(now)

    def on_scan_moves(self, listener: ScanListener | None) -> None:
        self._scans.on_moves(listener)

    # the hooks the store's task rows call, and MemoryScans calls back

    def task_or_none(self, task_id: str | None) -> Task | None:
        row = None if task_id is None else self._rows.get(task_id)
        return None if row is None else row.task

    def attempts_started(self, task_id: str | None) -> int:
        """The attempts a task has started, an interrupted one (given back to its count) included."""
        row = None if task_id is None else self._rows.get(task_id)
        return 0 if row is None else len(row.attempts)

    def insert_step(self, new: NewTask, now: float, step: tuple[str, int, int]) -> Task:
        task = self._insert(new, now)
        self._rows[task.id].scan = step
        return task

    def _step_ended(self, row: _Row, now: float, learned: dict[str, Any] | None = None) -> None:
        """A scan step's task that ended for good moves its scan on."""
        if row.scan is not None and row.task.state.terminal:
            self._scans.job_ended(row.scan[0], row.scan[1], row.task.id, job_state_of(row.task.state), learned, now)


class MemoryScans:
    def __init__(self, store: MemoryStore, new_id: Callable[[float], str]) -> None:
        self._store = store
        self._new_id = new_id
        self.rows: dict[str, ScanRow] = {}
        self._keys: dict[str, str] = {}
        self._moves: list[ScanMove] = []
        self._listener: ScanListener | None = None

    def on_moves(self, listener: ScanListener | None) -> None:
        self._listener = listener

    def flush(self) -> list[ScanMove]:
        """The moves made since the last flush, told to the listener."""
        moves, self._moves = self._moves, []
        if moves and self._listener is not None:
            self._listener(moves)
        return moves

    def add(self, new: NewScan, now: float, max_queued: int | None) -> tuple[Scan, bool]:
        if new.idempotency_key and new.idempotency_key in self._keys:
            row = self.rows[self._keys[new.idempotency_key]]
            if row.fingerprint != new.fingerprint():
                raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another scan body")
            return self.scan(row), False
        self._store.check_room(1, max_queued)
        row = ScanRow(self._new_id(now), new, new.fingerprint(), [JobRow(s) for s in new.steps], now, now)
        self.rows[row.id] = row
        if new.idempotency_key:
            self._keys[new.idempotency_key] = row.id
        self._start(row, 0, now)
        return self.scan(row), True

    def get(self, scan_id: str) -> Scan:
        return self.scan(self._row(scan_id))

    def page(self, state: ScanState | None, profile: str | None, limit: int, cursor: str | None) -> ScanPage:
        picked = []
        for scan_id in sorted(self.rows, reverse=True):
            if cursor is not None and scan_id >= cursor:
                continue
            scan = self.scan(self.rows[scan_id])
            if (state is None or scan.state is state) and (profile is None or scan.profile == profile):
                picked.append(scan)
                if len(picked) > limit:
                    break
        return ScanPage(picked[:limit], picked[limit - 1].id if len(picked) > limit else None)

    def cancel(self, scan_id: str, now: float) -> ScanCancel:
        row = self._row(scan_id)
        if row.state is ScanState.CANCELLED or (row.state is ScanState.RUNNING and row.cancel_requested_at):
            return ScanCancel(row.state, False)
        if row.state.ended:
            raise Conflict(f"scan {scan_id} is {row.state.value}; only a running scan can be cancelled")
        row.cancel_requested_at, row.updated_at = now, now
        index = next((i for i, j in enumerate(row.jobs) if j.state is JobState.STARTED), None)
        task_id = None if index is None else row.jobs[index].task_id
        task = self._task(task_id)
        answer = None
        if task is not None and not task.state.terminal:
            answer = self._store.cancel_row(task.id, now)  # a queued task ends now, and the scan with it
            task = self._task(task_id)
        if row.state is ScanState.RUNNING:
            if index is None:
                self.advance(row, now)
            elif task is None or task.state.terminal:  # its end was not applied yet
                self.job_ended(row.id, index, task_id, job_state_of(task.state) if task else JobState.FAILED,
                               None, now)
            else:  # its task is stopping: the scan ends when it has, and nothing waits behind it any more
                for job in row.jobs:
                    if job.state is JobState.WAITING:
                        job.state = JobState.SKIPPED
        self.flush()
        return ScanCancel(row.state, True, task_id, answer)

    def retry(self, scan_id: str, index: int, now: float, max_queued: int | None) -> Scan:
        row = self._row(scan_id)
        scan = self.scan(row)
        try:
            states = retry_from(scan, index)
        except IndexError:
            raise InvalidRequest("index", f"scan {scan_id} has jobs 0 to {len(row.jobs) - 1}") from None
        except ValueError as exc:
            raise Conflict(str(exc)) from None
        self._store.check_room(1, max_queued)
        for job, state in zip(row.jobs, states, strict=True):
            job.state = state
        row.state, row.finished_at, row.cancel_requested_at, row.updated_at = ScanState.RUNNING, None, None, now
        row.scope = dict(row.jobs[index].scope_before)
        self._start(row, index, now)
        return self.scan(row)

    def advance_all(self, now: float) -> list[ScanMove]:
        for row in list(self.rows.values()):
            if row.state is not ScanState.RUNNING:
                continue
            live = next((i for i, j in enumerate(row.jobs) if j.state is JobState.STARTED), None)
            if live is None:
                self.advance(row, now)
                continue
            task_id = row.jobs[live].task_id
            task = self._task(task_id)
            if task is None or task.state.terminal:  # ended without its scan being told: learned nothing known
                self.job_ended(row.id, live, task_id, job_state_of(task.state) if task else JobState.FAILED,
                               {}, now)
        return self.flush()

    # the hook: a step task ended

    def scope_after(self, scan_id: str, learned: dict[str, Any] | None) -> dict[str, Any]:
        """The scan's scope with what a succeeding step learned (ScopeRefused past the bound)."""
        row = self.rows.get(scan_id)
        return {} if row is None else merge_scope(row.scope, learned)

    def job_ended(self, scan_id: str, index: int, task_id: str | None, ended: JobState,
                  learned: dict[str, Any] | None, now: float) -> None:
        row = self.rows.get(scan_id)
        if row is None or row.state.ended or row.jobs[index].state is not JobState.STARTED \
                or row.jobs[index].task_id != task_id:
            return  # not this scan's current task (a stale one): nothing of the scan moves
        scope = self.scope_after(scan_id, learned) if ended is JobState.SUCCESS else row.scope
        self._apply(row, plan([j.state for j in row.jobs], scope=scope, ended=(index, ended),
                              continue_on_failure=row.new.continue_on_failure,
                              cancel_requested=row.cancel_requested_at is not None), now, (index, ended))

    def advance(self, row: ScanRow, now: float) -> None:
        self._apply(row, plan([j.state for j in row.jobs], scope=row.scope,
                              continue_on_failure=row.new.continue_on_failure,
                              cancel_requested=row.cancel_requested_at is not None), now, None)

    def _apply(self, row: ScanRow, p: Plan, now: float, ended: tuple[int, JobState] | None) -> None:
        for job, state in zip(row.jobs, p.states, strict=True):
            job.state = state
        row.scope, row.updated_at = p.scope, now
        move = ScanMove(row.id, row.new.profile, *(ended or (None, None)))
        if p.start is not None:
            task = self._start(row, p.start, now)
            move = dataclasses.replace(move, task_id=task.id, type=task.type, started=p.start)
        if p.finish is not None:
            row.state, row.finished_at = p.finish, now
            move = dataclasses.replace(move, finished=p.finish)
        if move != ScanMove(row.id, row.new.profile):
            self._moves.append(move)

    def _start(self, row: ScanRow, index: int, now: float) -> Task:
        job = row.jobs[index]
        job.state, job.scope_before = JobState.STARTED, dict(row.scope)
        new: NewTask = step_task(job.step, payload=row.new.payload, scope=row.scope, priority=row.new.priority,
                                 organization=row.new.organization)
        task = self._store.insert_step(new, now, (row.id, index, job.tasks))
        job.task_id, job.tasks = task.id, job.tasks + 1
        return task

    # reads

    def _row(self, scan_id: str) -> ScanRow:
        try:
            return self.rows[scan_id]
        except KeyError:
            raise ScanNotFound(scan_id) from None

    def scan(self, row: ScanRow) -> Scan:
        jobs = tuple(self._job(i, j) for i, j in enumerate(row.jobs))
        return Scan(row.id, row.new.profile, shown_scan(row.state, jobs), row.new.organization, row.new.payload,
                    dict(row.scope), row.new.priority, row.new.continue_on_failure, row.new.idempotency_key, jobs,
                    row.created_at, row.updated_at, row.finished_at, row.cancel_requested_at)

    def _task(self, task_id: str | None) -> Task | None:
        """The task, None when it is gone (pruned) or there is none."""
        return self._store.task_or_none(task_id)

    def _job(self, index: int, job: JobRow) -> Job:
        task = self._task(job.task_id)
        state: State | None = None if task is None else task.state
        return Job(index, job.step.type, shown(job.state, state), job.task_id,
                   self._store.attempts_started(job.task_id), None if task is None else task.error, job.tasks)

    def prune(self, before: float) -> None:
        for scan_id in [i for i, r in self.rows.items()
                        if r.state.ended and r.finished_at is not None and r.finished_at < before]:
            row = self.rows.pop(scan_id)
            if row.new.idempotency_key:
                self._keys.pop(row.new.idempotency_key, None)
