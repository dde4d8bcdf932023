"""The memory store's leases: a worker's verbs on the task rows, each write fenced by attempt id + lease token,
and the one ending every path that ends an attempt goes through."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ...errors import Conflict, DeadlinePassed, LeaseLost, TaskCancelling, TidepoolError
from ...lifecycle import Event, RetryPolicy, decide_end, step
from ...model import (
    QUEUED,
    Attempt,
    AttemptStatus,
    Claimed,
    ClaimFilter,
    Lease,
    Outcome,
    ResultBatch,
    State,
    Worker,
    new_token,
)
from ...scans import ScopeRefused
from ..bounds import capped, check_quota, past_deadline, payload_bytes
from ..port import Ending, PhaseNote, ResultQuota
from ..rules import glob_matches, may_end
from . import scans
from .database import Database, TaskRow


def claim(db: Database, worker: Worker, where: ClaimFilter, *, limit: int, now: float, lease_s: float) -> list[Claimed]:
    return [lease_row(db, row, worker, now=now, lease_s=lease_s) for row in claimable(db, where, now=now)[:limit]]


def renew(db: Database, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
    lost: dict[str, LeaseLost] = {}
    for lease in leases:
        try:
            row = fenced(db, lease, now)
        except LeaseLost as exc:
            lost[lease.attempt_id] = exc
            continue
        row.lease = dataclasses.replace(lease, expires_at=capped(now + lease_s, deadline_of(row)))
    return lost


def set_phase(db: Database, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
    lost: dict[str, LeaseLost] = {}
    for note in notes:
        try:
            row = fenced(db, note.lease, now)
        except LeaseLost as exc:
            lost[note.lease.attempt_id] = exc
            continue
        if row.task.state is State.LEASED:
            row.update(state=step(State.LEASED, Event.START))
            row.set_attempt(note.lease.attempt_id, status=AttemptStatus.RUNNING)
        if note.deadline_s is not None and deadline_of(row) is None:
            row.set_attempt(note.lease.attempt_id, deadline_at=now + note.deadline_s)
        progress = note.progress if note.progress is not None else row.task.progress
        row.update(phase=note.phase, progress=progress, updated_at=now)
    return lost


def record_result(db: Database, lease: Lease, batch: ResultBatch, *, now: float,
                  quota: ResultQuota | None = None) -> ResultBatch:
    row = fenced(db, lease, now)
    for other in db.tasks.values():
        for earlier in other.results:
            if earlier.idempotency_key == batch.idempotency_key:
                if earlier.sha256 != batch.sha256:
                    raise Conflict(f"result key {batch.idempotency_key} was stored with another sha256")
                return earlier
    stored = [r for r in row.results if r.attempt_id == lease.attempt_id]
    check_quota(quota, task_id=lease.task_id, attempt_id=lease.attempt_id, count=len(stored),
                stored_bytes=sum(payload_bytes(r) for r in stored), adding=payload_bytes(batch))
    batch = dataclasses.replace(batch, attempt_id=lease.attempt_id, stored_now=False)
    row.results.append(batch)
    return dataclasses.replace(batch, stored_now=True)


def finish_many(db: Database, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
    results: list[State | TidepoolError] = []
    for e in endings:
        try:
            row = fenced(db, e.lease, e.now, ending=True)
            end(db, row, e.outcome, now=e.now, policy=policy)
        except TidepoolError as exc:  # LeaseLost, InvalidTransition: nothing of this ending was written
            results.append(exc)
            continue
        results.append(row.task.state)
    scans.flush(db)
    return results


def claimable(db: Database, where: ClaimFilter, *, now: float,
              type_globs: tuple[str, ...] | None = None) -> list[TaskRow]:
    """The rows `where` may lease now, in queue order; with type_globs, only types one of them matches."""
    ready = [r for r in db.tasks.values() if r.task.state in QUEUED and r.task.available_at <= now
             and r.task.attempt < r.task.max_attempts and where.accepts_type(r.task.type)
             and where.satisfies(r.task.required_tags) and where.accepts_organization(r.task.organization)
             and (type_globs is None or any(glob_matches(g, r.task.type) for g in type_globs))]
    ready.sort(key=lambda r: (-r.task.priority, r.task.created_at, r.task.id))
    return ready


def lease_row(db: Database, row: TaskRow, worker: Worker, *, now: float, lease_s: float) -> Claimed:
    lease = Lease(row.task.id, db.new_id(now), new_token(), now + lease_s)
    row.attempts.append(Attempt(lease.attempt_id, row.task.id, len(row.attempts) + 1, worker.node_id,
                                worker.worker_id, AttemptStatus.LEASED, now))
    row.update(state=step(row.task.state, Event.CLAIM), attempt=row.task.attempt + 1,
               node_id=worker.node_id, phase=None, progress=None, error=None, updated_at=now)
    row.lease, row.lease_instance = lease, worker.instance_id
    return Claimed(row.task, lease)


def end(db: Database, row: TaskRow, outcome: Outcome, *, now: float, policy: RetryPolicy) -> None:
    """End the row's attempt as `outcome` says, and move a step's scan with it."""
    assert row.lease is not None
    if row.scan is not None and outcome.status is AttemptStatus.SUCCEEDED:
        try:  # what the step learned must fit in its scan, or the step fails saying so
            scans.scope_after(db, row.scan[0], outcome.scope)
        except ScopeRefused as exc:
            outcome = dataclasses.replace(outcome, status=AttemptStatus.FAILED, error=exc.error)
    t = row.task
    ended = decide_end(t.state, outcome, attempt=t.attempt, max_attempts=t.max_attempts,
                       interruptions=t.interruptions, policy=policy, now=now)
    row.set_attempt(row.lease.attempt_id, status=ended.attempt_status, finished_at=now, error=ended.error,
                    exit_status=outcome.exit_status, stderr_tail=outcome.stderr_tail)
    queued = ended.state in QUEUED
    row.update(
        state=ended.state, error=ended.error, updated_at=now, phase=None,
        progress=t.progress if outcome.progress is None else outcome.progress,
        attempt=t.attempt - 1 if ended.uncount_attempt else t.attempt,
        interruptions=t.interruptions + 1 if ended.uncount_attempt else t.interruptions,
        available_at=ended.available_at if ended.available_at is not None else t.available_at,
        finished_at=None if queued else now,
    )
    row.lease = None
    scans.step_ended(db, row, now, outcome.scope)


def fenced(db: Database, lease: Lease, now: float, *, ending: bool = False) -> TaskRow:
    """The row a worker's write may change: its lease live (or, for an ending, a cancel to acknowledge)."""
    row = db.tasks.get(lease.task_id)
    if row is None or row.lease is None or (row.lease.attempt_id, row.lease.token) != (lease.attempt_id, lease.token):
        raise LeaseLost(lease.task_id, lease.attempt_id)
    if ending and may_end(row.task.state, row.lease.expires_at, now):
        return row
    if row.task.state is State.CANCELLING:
        raise TaskCancelling(lease.task_id, lease.attempt_id)
    if not row.task.state.active or row.lease.expires_at <= now:
        if past_deadline(deadline_of(row), now):
            raise DeadlinePassed(lease.task_id, lease.attempt_id)
        raise LeaseLost(lease.task_id, lease.attempt_id)
    return row


def deadline_of(row: TaskRow) -> float | None:
    """The run deadline of the row's leased attempt (None before its run phase)."""
    assert row.lease is not None
    return next((a.deadline_at for a in row.attempts if a.id == row.lease.attempt_id), None)
