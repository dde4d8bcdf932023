"""The scans' rows both SQL adapters read, and what a scan's next move writes, decided alike for both.

A scan row is SCAN_COLUMNS; a job row JOB_COLUMNS followed by its task's state, attempts started and error
(a LEFT JOIN: NULL once the task is pruned). A scan step's task row names its scan, job index and retry
number (tasks.scan_id, scan_index, scan_retry), so the transaction that ends it finds its scan.

A scan's payload and scope, and its steps' task payloads, are stored as the compact JSON their bounds are
measured in (canonical_json), not json.dumps' default, whose escapes and spaces would store more.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..model import NewTask, State, canonical_json
from ..scans import (
    Job,
    JobState,
    NewScan,
    Plan,
    Scan,
    ScanState,
    StepSpec,
    merge_scope,
    plan,
    shown,
    shown_scan,
    step_task,
)
from .port import ScanMove
from .rows import error_of, loads

SCAN_COLUMNS = ("id, profile, state, organization, payload, scope, priority, continue_on_failure, idempotency_key, "
                "created_at, updated_at, finished_at, cancel_requested_at")
JOB_COLUMNS = "scan_id, idx, step, state, task_id, tasks, scope_before"


def scan_values(scan_id: str, new: NewScan, now: float) -> tuple[Any, ...]:
    """A new scan's row: SCAN_COLUMNS, then its fingerprint."""
    return (scan_id, new.profile, ScanState.RUNNING.value, new.organization, canonical_json(new.payload), "{}",
            new.priority, new.continue_on_failure, new.idempotency_key, now, now, None, None, new.fingerprint())


def job_values(scan_id: str, new: NewScan) -> list[tuple[Any, ...]]:
    """A new scan's job rows: (scan_id, idx, step), each waiting."""
    return [(scan_id, i, json.dumps(s.to_json())) for i, s in enumerate(new.steps)]


def job_of(row: Sequence[Any]) -> Job:
    """A Job from a JOB_COLUMNS row and its task's (state, attempts started, error)."""
    task_state = None if row[7] is None else State(row[7])
    return Job(row[1], json.loads(row[2])["type"], shown(JobState(row[3]), task_state), row[4],
               row[8] or 0, None if row[9] is None else error_of(row[9]), row[5])


def scan_of(row: Sequence[Any], jobs: Sequence[Sequence[Any]]) -> Scan:
    """A Scan from a SCAN_COLUMNS row and its job rows, in index order."""
    shown_jobs = tuple(job_of(j) for j in jobs)
    return Scan(row[0], row[1], shown_scan(ScanState(row[2]), shown_jobs), row[3], loads(row[4]), loads(row[5]),
                row[6], bool(row[7]), row[8], shown_jobs, row[9], row[10], row[11], row[12])


@dataclass(frozen=True, slots=True)
class Stored:
    """A scan as its next move needs it: its row and its jobs' rows (with their tasks' states)."""

    row: Sequence[Any]
    jobs: Sequence[Sequence[Any]]

    @property
    def id(self) -> str:
        return str(self.row[0])

    @property
    def running(self) -> bool:
        return bool(self.row[2] == ScanState.RUNNING)

    def states(self) -> list[JobState]:
        return [JobState(j[3]) for j in self.jobs]

    def started(self) -> int | None:
        """The index of the job whose task is live (or ended without its end applied), if one is."""
        return next((j[1] for j in self.jobs if j[3] == JobState.STARTED), None)

    def scope(self) -> dict[str, Any]:
        return dict(loads(self.row[5]))

    def is_current(self, index: int, task_id: str) -> bool:
        """Whether `task_id` is job `index`'s live task in this running scan (not a stale one)."""
        job = self.jobs[index]
        return self.running and job[3] == JobState.STARTED and job[4] == task_id


@dataclass(frozen=True, slots=True)
class Writes:
    """What a store writes for a scan's move, in one transaction."""

    jobs: list[tuple[int, JobState]]      # job states that change (a started job's is written with its task)
    start: tuple[int, NewTask, str, int] | None  # (index, its task, the scope before it as JSON, retry number)
    state: ScanState
    scope: str
    finished_at: float | None
    move: ScanMove | None


def writes(stored: Stored, *, now: float, ended: tuple[int, JobState] | None = None,
           learned: dict[str, Any] | None = None) -> Writes:
    """A scan's next move once job `ended[0]` ended as `ended[1]` having learned `learned`, or, with nothing
    ended, whatever its jobs call for (the reconciler)."""
    scope = stored.scope()
    if ended is not None and ended[1] is JobState.SUCCESS:
        scope = merge_scope(scope, learned)
    row = stored.row
    p: Plan = plan(stored.states(), scope=scope, ended=ended, continue_on_failure=bool(row[7]),
                   cancel_requested=row[12] is not None)
    before = stored.states()
    changed = [(i, s) for i, (old, s) in enumerate(zip(before, p.states, strict=True))
               if s != old and i != p.start]
    start = None
    move = ScanMove(stored.id, row[1], *(ended or (None, None)))
    if p.start is not None:
        job = stored.jobs[p.start]
        task = step_task(StepSpec.of_json(json.loads(job[2])), payload=loads(row[4]), scope=p.scope,
                         priority=row[6], organization=row[3])
        start = (p.start, task, canonical_json(p.scope), job[5])
        move = ScanMove(move.scan_id, move.profile, move.index, move.job, type=task.type, started=p.start)
    if p.finish is not None:
        move = ScanMove(move.scan_id, move.profile, move.index, move.job, move.task_id, move.type, move.started,
                        p.finish)
    quiet = move == ScanMove(stored.id, row[1])
    return Writes(changed, start, p.finish or ScanState.RUNNING, canonical_json(p.scope),
                  now if p.finish is not None else None, None if quiet else move)
