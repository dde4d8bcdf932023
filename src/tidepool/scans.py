"""Scans: a profile's steps run as one durable task each, and the pure rules of moving from step to step.

A scan holds what every step's task needs (its type and the task defaults resolved when the scan was
submitted), so whichever node ends a step can create the next step's task in the same transaction,
without the config. What each step's plugins put in `ctx.scope` is merged, at the top level, into the
scan's scope; the next step's task gets the scan's payload with that scope merged over it, so a learned
key is a payload field like any other (usable as a command's `{name}`).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .model import DEFAULT_ORGANIZATION, NewTask, State, TaskError, canonical_json

# A scan's scope as compact JSON may not grow past this: it travels in every later step's payload, and a
# plugin that dumps a whole scan output there should fail its step, not bloat every task after it.
SCOPE_MAX_BYTES = 64 * 1024


class ScanState(enum.StrEnum):
    """A scan's state. The stores keep RUNNING and the ends; PENDING is how a running scan reads while
    nothing of it has run yet (its first job's first task is queued and has started no attempt)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in (ScanState.SUCCEEDED, ScanState.FAILED, ScanState.CANCELLED)


class JobState(enum.StrEnum):
    """A job's state as a user reads it. The stores keep WAITING, STARTED (read from its task), the ends
    and SKIPPED; QUEUED and RUNNING are what a STARTED job's task is doing."""

    WAITING = "waiting"      # its step has not come
    STARTED = "started"      # stored only: its task exists and its end has not been applied
    QUEUED = "queued"
    RUNNING = "running"
    SUCCESS = "success"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"

    @property
    def ended(self) -> bool:
        return self in JOB_ENDS or self is JobState.SKIPPED

    @property
    def retryable(self) -> bool:
        return self in (JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED)


JOB_ENDS = frozenset({JobState.SUCCESS, JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED})

_OF_TASK = {
    State.PENDING: JobState.QUEUED, State.RETRY_WAIT: JobState.QUEUED,
    State.LEASED: JobState.RUNNING, State.RUNNING: JobState.RUNNING, State.CANCELLING: JobState.RUNNING,
    State.COMPLETED: JobState.SUCCESS, State.FAILED: JobState.FAILED, State.TIMED_OUT: JobState.TIMEOUT,
    State.CANCELLED: JobState.CANCELLED,
}


def job_state_of(task_state: State) -> JobState:
    """What a started job reads as, from its task's state."""
    return _OF_TASK[task_state]


@dataclass(frozen=True, slots=True)
class StepSpec:
    """One step of a scan: its task type and the task defaults the submitting node resolved for it."""

    type: str
    max_attempts: int = 3
    timeout_s: float | None = None
    required_tags: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "max_attempts": self.max_attempts, "timeout_s": self.timeout_s,
                "required_tags": sorted(self.required_tags)}

    @classmethod
    def of_json(cls, data: Mapping[str, Any]) -> StepSpec:
        return cls(data["type"], data["max_attempts"], data["timeout_s"], tuple(data["required_tags"]))


@dataclass(frozen=True, slots=True)
class NewScan:
    """A validated scan submission, before the store gives it an id. `steps` are the profile's, resolved."""

    profile: str
    steps: tuple[StepSpec, ...]
    payload: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    organization: str = DEFAULT_ORGANIZATION
    continue_on_failure: bool = False
    idempotency_key: str | None = None
    inputs: dict[str, str] = field(default_factory=dict)  # file name -> sha256: every step's task gets them

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError(f"scan of profile {self.profile!r}: a scan needs at least one step")

    def fingerprint(self) -> str:
        """What makes two submits with one idempotency key "the same body": what the submitter sent. The
        steps are the profile's, not the body's: a config reload between two tries is the same scan."""
        if self.idempotency_key is None:
            return ""
        body: list[Any] = [self.profile, self.payload, self.priority, self.organization]
        if self.inputs:  # appended, so that bodies without inputs hash as they always have
            body.append(["inputs", self.inputs])
        return hashlib.sha256(canonical_json(body).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Job:
    """One step of one scan. `task_id` is its latest task (None while waiting or skipped unstarted);
    `attempts` (those it has started, an interrupted one included) and `error` are that task's; `tasks`
    counts the tasks it has had (the next one's retry number)."""

    index: int
    step: str
    state: JobState
    task_id: str | None = None
    attempts: int = 0
    error: TaskError | None = None
    tasks: int = 0
    artifacts: dict[str, str] = field(default_factory=dict)  # its latest task's artifacts: name -> sha256


@dataclass(frozen=True, slots=True)
class Scan:
    id: str
    profile: str
    state: ScanState
    organization: str
    payload: dict[str, Any]
    scope: dict[str, Any]
    priority: int
    continue_on_failure: bool
    idempotency_key: str | None
    jobs: tuple[Job, ...]
    created_at: float
    updated_at: float
    finished_at: float | None
    cancel_requested_at: float | None = None
    inputs: dict[str, str] = field(default_factory=dict)  # as submitted: file name -> sha256


# the rules


class ScopeRefused(Exception):
    """What a step's plugins put in ctx.scope cannot be kept: its step fails with this error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.error = TaskError(code, message, retryable=False)


def merge_scope(scope: Mapping[str, Any], learned: Mapping[str, Any] | None) -> dict[str, Any]:
    """The scan's scope after a step that learned `learned`: merged at the top level, the newer key winning.
    ScopeRefused when it is not a mapping, not JSON, or its compact JSON would pass SCOPE_MAX_BYTES."""
    if learned is not None and not isinstance(learned, Mapping):  # a plugin may have set ctx.scope to anything
        raise ScopeRefused("scope_not_json", f"ctx.scope must be a mapping of names to JSON values, not a "
                           f"{type(learned).__name__}")
    try:
        merged = {**scope, **(learned or {})}
        size = len(canonical_json(merged).encode())
    except (TypeError, ValueError) as exc:
        raise ScopeRefused("scope_not_json", f"ctx.scope holds a value JSON cannot carry: {exc}") from None
    if size > SCOPE_MAX_BYTES:
        raise ScopeRefused("scope_too_large", f"the scan's scope would be {size} bytes of compact JSON with what "
                           f"this step put in ctx.scope; a scan's scope is bounded at {SCOPE_MAX_BYTES} bytes")
    return merged


def step_task(step: StepSpec, *, payload: Mapping[str, Any], scope: Mapping[str, Any], priority: int,
              organization: str) -> NewTask:
    """A step's task: its step's type and defaults, the scan's priority and organization, the scan's payload
    with the scope so far merged over it at the top level."""
    return NewTask(type=step.type, payload={**payload, **scope}, priority=priority, max_attempts=step.max_attempts,
                   timeout_s=step.timeout_s, required_tags=step.required_tags, organization=organization)


@dataclass(frozen=True, slots=True)
class Advance:
    """What follows a job's end: the next job to start, or the scan's end (with the jobs it skips)."""

    start: int | None = None
    finish: ScanState | None = None
    skip: tuple[int, ...] = ()


def after_job(states: Sequence[JobState], *, continue_on_failure: bool, cancel_requested: bool) -> Advance:
    """What a scan does next, given its jobs' states (as stored, a job whose end was just applied included),
    when none of them is STARTED: start the first waiting job, or end the scan.

    A cancel requested skips every waiting job and ends the scan cancelled. A job that failed, timed out
    or was cancelled ends the scan failed (cancelled for a cancelled one), skipping the jobs after it,
    unless the scan continues on failure: then the scan runs every step and ends failed if any did.
    """
    assert JobState.STARTED not in states, "a job's task is live: nothing to decide yet"
    waiting = tuple(i for i, s in enumerate(states) if s is JobState.WAITING)
    if cancel_requested:
        return Advance(finish=ScanState.CANCELLED, skip=waiting)
    if not continue_on_failure:
        for state in states:
            if state in (JobState.FAILED, JobState.TIMEOUT):
                return Advance(finish=ScanState.FAILED, skip=waiting)
            if state is JobState.CANCELLED:
                return Advance(finish=ScanState.CANCELLED, skip=waiting)
    if waiting:
        return Advance(start=waiting[0])
    done = all(s in (JobState.SUCCESS, JobState.SKIPPED) for s in states)
    return Advance(finish=ScanState.SUCCEEDED if done else ScanState.FAILED)


@dataclass(frozen=True, slots=True)
class Plan:
    """What a store writes for a scan after one of its jobs ended (or when the reconciler looks at it): the
    jobs' new stored states, the scan's scope, the job to create a task for, the scan's end."""

    states: tuple[JobState, ...]
    scope: dict[str, Any]
    start: int | None = None
    finish: ScanState | None = None


def plan(states: Sequence[JobState], *, scope: dict[str, Any], ended: tuple[int, JobState] | None = None,
         continue_on_failure: bool, cancel_requested: bool) -> Plan:
    """The scan's next step once job `ended[0]` ended as `ended[1]` (its learned scope already merged into
    `scope`), or, with nothing ended, once none of its jobs is started (the reconciler). A scan whose job
    is still started has nothing to do: the plan changes nothing."""
    now = list(states)
    if ended is not None:
        now[ended[0]] = ended[1]
    if JobState.STARTED in now:
        return Plan(tuple(now), scope)
    move = after_job(now, continue_on_failure=continue_on_failure, cancel_requested=cancel_requested)
    for i in move.skip:
        now[i] = JobState.SKIPPED
    if move.start is not None:
        now[move.start] = JobState.STARTED
    return Plan(tuple(now), scope, move.start, move.finish)


def retry_from(scan: Scan, index: int) -> list[JobState]:
    """The jobs' stored states once job `index` of an ended scan is retried: it starts again, and every job
    after it waits for its turn again. Conflict-worthy requests raise ValueError with the reason."""
    if not scan.state.ended:
        raise ValueError(f"scan {scan.id} is {scan.state.value}; only a job of an ended scan can be retried")
    if not 0 <= index < len(scan.jobs):
        raise IndexError(index)
    job = scan.jobs[index]
    if not job.state.retryable:
        raise ValueError(f"job {index} of scan {scan.id} is {job.state.value}; only a failed, timed-out or "
                         "cancelled job can be retried")
    return [s.state if s.index < index else JobState.STARTED if s.index == index else JobState.WAITING
            for s in scan.jobs]


def shown(stored: JobState, task_state: State | None) -> JobState:
    """What a job reads as: a started job as its task stands (its end may not be applied yet)."""
    if stored is JobState.STARTED:
        return JobState.QUEUED if task_state is None else job_state_of(task_state)
    return stored


def shown_scan(stored: ScanState, jobs: Sequence[Job]) -> ScanState:
    """What a scan reads as, from its stored state and its jobs as shown (none when they are being pruned)."""
    if stored is not ScanState.RUNNING or not jobs:
        return stored
    first = jobs[0]
    if first.state is JobState.QUEUED and first.tasks == 1 and not first.attempts:
        return ScanState.PENDING  # only one job is started at a time: every later one is waiting
    return stored

