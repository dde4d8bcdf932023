"""The memory store's database: its tables as plain data, and the three writes to them that more than one noun
makes (a task row inserted, the room left in the queue, a task row cancelled).

Those three live here, below the nouns, because the nouns call each other in a circle otherwise: a task's end
moves its scan (scans.py), and a scan inserts, counts and cancels tasks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ...model import (
    CANCELLED_ON_REQUEST,
    QUEUED,
    Artifact,
    Attempt,
    Blob,
    Lease,
    NewTask,
    RemoteWorker,
    ResultBatch,
    State,
    Task,
    new_id,
)
from ...scans import JobState, NewScan, ScanState, StepSpec
from ...schedules import Schedule
from .. import rules
from ..port import CancelAnswer, Node, ScanListener, ScanMove


@dataclasses.dataclass
class TaskRow:
    task: Task
    fingerprint: str
    lease: Lease | None = None
    lease_instance: str | None = None
    cancel_requested_at: float | None = None
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    results: list[ResultBatch] = dataclasses.field(default_factory=list)
    artifacts: list[Artifact] = dataclasses.field(default_factory=list)  # every attempt's, oldest first
    scan: tuple[str, int, int] | None = None  # a scan step's task: (scan id, job index, retry number)

    def update(self, **changes: Any) -> None:
        self.task = dataclasses.replace(self.task, **changes)

    def set_attempt(self, attempt_id: str, **changes: Any) -> None:
        self.attempts = [dataclasses.replace(a, **changes) if a.id == attempt_id else a
                         for a in self.attempts]


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


@dataclasses.dataclass
class Database:
    """Every table, empty at first: nothing persists."""

    tasks: dict[str, TaskRow] = dataclasses.field(default_factory=dict)
    task_keys: dict[str, str] = dataclasses.field(default_factory=dict)  # idempotency key -> task id
    schedules: dict[str, Schedule] = dataclasses.field(default_factory=dict)
    nodes: dict[str, Node] = dataclasses.field(default_factory=dict)
    workers: dict[str, RemoteWorker] = dataclasses.field(default_factory=dict)
    scans: dict[str, ScanRow] = dataclasses.field(default_factory=dict)
    scan_keys: dict[str, str] = dataclasses.field(default_factory=dict)  # idempotency key -> scan id
    blobs: dict[str, Blob] = dataclasses.field(default_factory=dict)  # by sha256
    blob_bytes: dict[str, bytes] = dataclasses.field(default_factory=dict)  # by sha256
    moves: list[ScanMove] = dataclasses.field(default_factory=list)  # made since the listener was last told
    listener: ScanListener | None = None
    new_id: Callable[[float], str] = new_id


def insert(db: Database, new: NewTask, now: float) -> Task:
    task = Task(
        id=db.new_id(now), type=new.type, payload=new.payload, priority=new.priority, state=State.PENDING,
        phase=None, progress=None, attempt=0, max_attempts=new.max_attempts, interruptions=0,
        timeout_s=new.timeout_s, required_tags=tuple(sorted(new.required_tags)),
        idempotency_key=new.idempotency_key, node_id=None, error=None, created_at=now, updated_at=now,
        available_at=new.available_at if new.available_at is not None else now, finished_at=None,
        organization=new.organization, inputs=dict(new.inputs),
    )
    db.tasks[task.id] = TaskRow(task, new.fingerprint())
    if new.idempotency_key:
        db.task_keys[new.idempotency_key] = task.id
    return task


def check_room(db: Database, n: int, max_queued: int | None) -> None:
    """QueueFull when `n` more tasks would take the queue past max_queued."""
    if max_queued is None:
        return
    rules.check_room(sum(1 for r in db.tasks.values() if r.task.state in QUEUED), n, max_queued)


def cancel(row: TaskRow, now: float) -> CancelAnswer:
    """Move the row as a cancel request does; a step's task that ended so is the caller's to tell its scan."""
    state = rules.cancel_step(row.task.state)
    if state is row.task.state:
        return CancelAnswer(state, False, row.task.type)
    if state is State.CANCELLED:
        row.update(state=state, finished_at=now, updated_at=now, phase=None, error=CANCELLED_ON_REQUEST)
    else:
        row.update(state=state, updated_at=now)
        row.cancel_requested_at = now
    return CancelAnswer(state, True, row.task.type)
