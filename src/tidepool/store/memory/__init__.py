"""An in-process store: the reference fake that passes the same contract as the durable adapters."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus

from ... import schedules
from ...errors import Conflict, LeaseLost, ScheduleNotFound, TaskCancelling, TaskNotFound, TidepoolError
from ...lifecycle import Event, RetryPolicy, decide_end, step
from ...model import (
    CANCELLED_ON_REQUEST,
    QUEUED,
    Attempt,
    AttemptStatus,
    Claimed,
    ClaimFilter,
    Lease,
    NewTask,
    Outcome,
    RemoteWorker,
    ResultBatch,
    State,
    Task,
    Worker,
    new_id,
    new_token,
)
from ...scans import NewScan, ScopeRefused
from ...schedules import Fired, Schedule
from .. import rules
from ..port import CancelAnswer, Ending, Node, Page, PhaseNote
from ..rules import batch_answer, cancel_step, check_room, finish_alone, glob_matches, may_end, retry_step
from .scans import MemoryScans, ScanVerbs
from .upkeep import MemoryReconciler
from .workers import MemoryRegistry


@dataclasses.dataclass
class _Row:
    task: Task
    fingerprint: str
    lease: Lease | None = None
    lease_instance: str | None = None
    cancel_requested_at: float | None = None
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    results: list[ResultBatch] = dataclasses.field(default_factory=list)
    scan: tuple[str, int, int] | None = None  # a scan step's task: (scan id, job index, retry number)

    def update(self, **changes: Any) -> None:
        self.task = dataclasses.replace(self.task, **changes)

    def set_attempt(self, attempt_id: str, **changes: Any) -> None:
        self.attempts = [dataclasses.replace(a, **changes) if a.id == attempt_id else a
                         for a in self.attempts]


class MemoryStore(ScanVerbs, MemoryRegistry, MemoryReconciler):
    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}
        self._keys: dict[str, str] = {}
        self._schedules: dict[str, Schedule] = {}
        self._nodes: dict[str, Node] = {}
        self._scans = MemoryScans(self, new_id)
        self._workers: dict[str, RemoteWorker] = {}

    async def open(self, *, migrate: bool = True) -> int:
        return 0  # nothing persists: every open starts empty

    async def close(self) -> None:
        pass

    async def write_failure(self) -> str | None:
        return None

    # producers

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        existing = self._existing(new)
        if existing is not None:
            return existing, False
        self._check_room(1, max_queued)
        return self._insert(new, now), True

    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[tuple[str, bool]]:
        keys = [n.idempotency_key for n in batch if n.idempotency_key]
        if len(keys) != len(set(keys)):
            raise Conflict("idempotency_key repeats within the batch")
        existing = {n.idempotency_key: task.id for n in batch if (task := self._existing(n)) is not None}
        fresh = [n for n in batch if n.idempotency_key not in existing]
        if fresh:  # a batch sent again whole is answered even when the queue is full
            self._check_room(len(fresh), max_queued)
        return batch_answer(batch, existing, [self._insert(n, now).id for n in fresh])

    async def get(self, task_id: str) -> Task:
        row = self._row(task_id)
        return dataclasses.replace(row.task, attempts=tuple(row.attempts), results=tuple(row.results))

    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                   cursor: str | None = None, organization: str | None = None) -> Page:
        ids = sorted(self._rows, reverse=True)
        picked = [self._rows[i] for i in ids if (cursor is None or i < cursor)
                  and (state is None or self._rows[i].task.state is state)
                  and (type is None or self._rows[i].task.type == type)
                  and (organization is None or self._rows[i].task.organization == organization)][: limit + 1]
        tasks = [dataclasses.replace(r.task, attempts=tuple(r.attempts)) for r in picked[:limit]]
        return Page(tasks, tasks[-1].id if len(picked) > limit else None)

    async def counts(self) -> dict[State, int]:
        counts: dict[State, int] = {}
        for row in self._rows.values():
            if not row.task.state.terminal:
                counts[row.task.state] = counts.get(row.task.state, 0) + 1
        return counts

    async def organization_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self._rows.values():
            if not row.task.state.terminal:
                counts[row.task.organization] = counts.get(row.task.organization, 0) + 1
        return counts

    async def request_cancel(self, task_id: str, *, now: float) -> CancelAnswer:
        answer = self.cancel_row(task_id, now)
        self._scans.flush()
        return answer

    def cancel_row(self, task_id: str, now: float) -> CancelAnswer:
        row = self._row(task_id)
        state = cancel_step(row.task.state)
        if state is row.task.state:
            return CancelAnswer(state, False, row.task.type)
        if state is State.CANCELLED:
            row.update(state=state, finished_at=now, updated_at=now, phase=None, error=CANCELLED_ON_REQUEST)
            self._step_ended(row, now)
        else:
            row.update(state=state, updated_at=now)
            row.cancel_requested_at = now
        return CancelAnswer(state, True, row.task.type)

    async def retry(self, task_id: str, *, now: float, max_queued: int | None = None) -> Task:
        row = self._row(task_id)
        state = retry_step(row.task.state)
        if row.scan is not None:
            raise Conflict(rules.step_retry_refused(task_id, row.scan[0], row.scan[1]))
        self._check_room(1, max_queued)
        # A new budget: attempt counts from zero again; attempts[].number keeps counting every row.
        row.update(state=state, attempt=0, interruptions=0, available_at=now, updated_at=now,
                   finished_at=None, error=None, progress=None)
        return dataclasses.replace(row.task, attempts=tuple(row.attempts))

    # workers

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        return [self._lease(row, worker, now, lease_s) for row in self._claimable(where, now)[:limit]]

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        lost: dict[str, LeaseLost] = {}
        for lease in leases:
            try:
                row = self._fenced(lease, now)
            except LeaseLost as exc:
                lost[lease.attempt_id] = exc
                continue
            row.lease = dataclasses.replace(lease, expires_at=now + lease_s)
        return lost

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        lost: dict[str, LeaseLost] = {}
        for note in notes:
            try:
                row = self._fenced(note.lease, now)
            except LeaseLost as exc:
                lost[note.lease.attempt_id] = exc
                continue
            if row.task.state is State.LEASED:
                row.update(state=step(State.LEASED, Event.START))
                row.set_attempt(note.lease.attempt_id, status=AttemptStatus.RUNNING)
            progress = note.progress if note.progress is not None else row.task.progress
            row.update(phase=note.phase, progress=progress, updated_at=now)
        return lost

    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float) -> ResultBatch:
        row = self._fenced(lease, now)
        for rows in self._rows.values():
            for earlier in rows.results:
                if earlier.idempotency_key == batch.idempotency_key:
                    if earlier.sha256 != batch.sha256:
                        raise Conflict(f"result key {batch.idempotency_key} was stored with another sha256")
                    return earlier
        batch = dataclasses.replace(batch, attempt_id=lease.attempt_id, stored_now=False)
        row.results.append(batch)
        return dataclasses.replace(batch, stored_now=True)

    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        return await finish_alone(self, lease, outcome, now=now, policy=policy)

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        results: list[State | TidepoolError] = []
        for e in endings:
            try:
                row = self._fenced(e.lease, e.now, ending=True)
                self._end(row, e.outcome, e.now, policy)
            except TidepoolError as exc:  # LeaseLost, InvalidTransition: nothing of this ending was written
                results.append(exc)
                continue
            results.append(row.task.state)
        self._scans.flush()
        return results

    # schedules

    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        saved = schedules.merge(self._schedules.get(schedule.name), schedule, now)
        self._schedules[schedule.name] = saved
        return saved

    async def list_schedules(self) -> list[Schedule]:
        return [self._schedules[n] for n in sorted(self._schedules)]

    async def delete_schedule(self, name: str, *, config_node: str | None = None) -> None:
        schedule = self._schedules.get(name)
        if schedule is None or (config_node is not None and schedule.config_node != config_node):
            raise ScheduleNotFound(name)
        del self._schedules[name]

    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule:
        if name not in self._schedules:
            raise ScheduleNotFound(name)
        self._schedules[name] = schedules.set_paused(self._schedules[name], paused, now)
        return self._schedules[name]

    async def fire_schedules(self, *, now: float,
                             new_task: Callable[[Schedule, float], NewTask | NewScan] | None = None,
                             defines: Callable[[Schedule], bool] = lambda schedule: True,
                             max_queued: int | None = None) -> list[Fired]:
        def add(new: NewTask | NewScan) -> str | None:
            if isinstance(new, NewScan):
                try:  # a tick's scan exists already, with this body or an earlier one: the tick has fired
                    scan, created = self._scans.add(new, now, max_queued)
                except Conflict:
                    return None
                return scan.id if created else None
            if new.idempotency_key in self._keys:
                return None
            self._check_room(1, max_queued)
            return self._insert(new, now).id

        def running(started: str) -> bool:
            if started in self._scans.rows:
                return not self._scans.rows[started].state.ended
            return started in self._rows and not self._rows[started].task.state.terminal

        fired: list[Fired] = []
        for schedule in list(self._schedules.values()):
            if schedule.paused or schedule.next_run_at is None or schedule.next_run_at > now:
                continue
            if not defines(schedule):
                continue
            outcome, saved = schedules.fire(schedule, now, new_task=new_task, running=running, add=add)
            self._schedules[schedule.name] = saved
            fired.extend(outcome)
        return fired

    # the fleet: one process, nothing to lock and nothing to hear

    async def lock_node(self, node_id: str, instance_id: str) -> None:
        pass

    async def save_node(self, node: Node) -> None:
        self._nodes[node.node_id] = node

    async def list_nodes(self) -> list[Node]:
        return [self._nodes[k] for k in sorted(self._nodes)]

    async def watch(self, wake: Callable[[int], None], *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await anyio.sleep_forever()

    # internals

    def _row(self, task_id: str) -> _Row:
        try:
            return self._rows[task_id]
        except KeyError:
            raise TaskNotFound(task_id) from None

    def _existing(self, new: NewTask) -> Task | None:
        if not new.idempotency_key or new.idempotency_key not in self._keys:
            return None
        row = self._rows[self._keys[new.idempotency_key]]
        if row.fingerprint != new.fingerprint():
            raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another body")
        return row.task

    def check_room(self, n: int, max_queued: int | None) -> None:
        self._check_room(n, max_queued)

    def _check_room(self, n: int, max_queued: int | None) -> None:
        if max_queued is None:
            return
        check_room(sum(1 for r in self._rows.values() if r.task.state in QUEUED), n, max_queued)

    def _insert(self, new: NewTask, now: float) -> Task:
        task = Task(
            id=new_id(now), type=new.type, payload=new.payload, priority=new.priority, state=State.PENDING,
            phase=None, progress=None, attempt=0, max_attempts=new.max_attempts, interruptions=0,
            timeout_s=new.timeout_s, required_tags=tuple(sorted(new.required_tags)),
            idempotency_key=new.idempotency_key, node_id=None, error=None, created_at=now, updated_at=now,
            available_at=new.available_at if new.available_at is not None else now, finished_at=None,
            organization=new.organization,
        )
        self._rows[task.id] = _Row(task, new.fingerprint())
        if new.idempotency_key:
            self._keys[new.idempotency_key] = task.id
        return task

    def _claimable(self, where: ClaimFilter, now: float, type_globs: tuple[str, ...] | None = None) -> list[_Row]:
        """The rows `where` may lease now, in queue order; with type_globs, only types one of them matches."""
        ready = [r for r in self._rows.values() if r.task.state in QUEUED and r.task.available_at <= now
                 and r.task.attempt < r.task.max_attempts and where.accepts_type(r.task.type)
                 and where.satisfies(r.task.required_tags) and where.accepts_organization(r.task.organization)
                 and (type_globs is None or any(glob_matches(g, r.task.type) for g in type_globs))]
        ready.sort(key=lambda r: (-r.task.priority, r.task.created_at, r.task.id))
        return ready

    def _lease(self, row: _Row, worker: Worker, now: float, lease_s: float) -> Claimed:
        lease = Lease(row.task.id, new_id(now), new_token(), now + lease_s)
        row.attempts.append(Attempt(lease.attempt_id, row.task.id, len(row.attempts) + 1, worker.node_id,
                                    worker.worker_id, AttemptStatus.LEASED, now))
        row.update(state=step(row.task.state, Event.CLAIM), attempt=row.task.attempt + 1,
                   node_id=worker.node_id, phase=None, progress=None, error=None, updated_at=now)
        row.lease, row.lease_instance = lease, worker.instance_id
        return Claimed(row.task, lease)

    def _fenced(self, lease: Lease, now: float, *, ending: bool = False) -> _Row:
        """The row a worker's write may change: its lease live (or, for an ending, a cancel to acknowledge)."""
        row = self._rows.get(lease.task_id)
        if row is None or row.lease is None or (row.lease.attempt_id, row.lease.token) != (lease.attempt_id,
                                                                                             lease.token):
            raise LeaseLost(lease.task_id, lease.attempt_id)
        if ending and may_end(row.task.state, row.lease.expires_at, now):
            return row
        if row.task.state is State.CANCELLING:
            raise TaskCancelling(lease.task_id, lease.attempt_id)
        if not row.task.state.active or row.lease.expires_at <= now:
            raise LeaseLost(lease.task_id, lease.attempt_id)
        return row

    def _end(self, row: _Row, outcome: Outcome, now: float, policy: RetryPolicy) -> None:
        assert row.lease is not None
        if row.scan is not None and outcome.status is AttemptStatus.SUCCEEDED:
            try:  # what the step learned must fit in its scan, or the step fails saying so
                self._scans.scope_after(row.scan[0], outcome.scope)
            except ScopeRefused as exc:
                outcome = dataclasses.replace(outcome, status=AttemptStatus.FAILED, error=exc.error)
        t = row.task
        end = decide_end(t.state, outcome, attempt=t.attempt, max_attempts=t.max_attempts,
                         interruptions=t.interruptions, policy=policy, now=now)
        row.set_attempt(row.lease.attempt_id, status=end.attempt_status, finished_at=now, error=end.error,
                        exit_status=outcome.exit_status, stderr_tail=outcome.stderr_tail)
        queued = end.state in QUEUED
        row.update(
            state=end.state, error=end.error, updated_at=now, phase=None,
            progress=t.progress if outcome.progress is None else outcome.progress,
            attempt=t.attempt - 1 if end.uncount_attempt else t.attempt,
            interruptions=t.interruptions + 1 if end.uncount_attempt else t.interruptions,
            available_at=end.available_at if end.available_at is not None else t.available_at,
            finished_at=None if queued else now,
        )
        row.lease = None
        self._step_ended(row, now, outcome.scope)

