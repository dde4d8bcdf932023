"""Request and response shapes of the HTTP API, and the task JSON of SPEC §8."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from ..model import Attempt, AttemptStatus, NewTask, ResultBatch, Task, rfc3339
from ..schedules import MAX_NAME_LEN, NAME_PATTERN, Schedule
from ..settings import MAX_WORKERS, Tag

MAX_LIST_LIMIT = 1000
# The instants the task JSON can show: model.rfc3339 writes years below 1000 with fewer than four digits, and
# a float epoch within microseconds of year 10000 rounds up into it.
EARLIEST = datetime(1000, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)


class NoFields(BaseModel):
    """The body of a route that takes none, when one is sent anyway: {} and nothing more."""

    model_config = ConfigDict(extra="forbid")


class SubmitTask(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # default_factory: a literal {} or [] default is deep-copied for every task of a batch (measured: 8%
    # of a 2,000-task submit).
    type: str = Field(min_length=1, max_length=200)
    payload: dict[str, Any] = Field(default_factory=dict)
    priority: int = Field(0, ge=-1_000_000, le=1_000_000)
    max_attempts: int | None = Field(None, ge=1, le=1000)
    timeout_s: float | None = Field(None, gt=0, le=7 * 86400)
    required_tags: list[Tag] = Field(default_factory=list, max_length=64)
    idempotency_key: str | None = Field(None, min_length=1, max_length=512, pattern=r"^[^\x00]*$")  # no NUL
    available_at: datetime | None = None

    @field_validator("available_at")
    @classmethod
    def _in_range(cls, at: datetime | None) -> datetime | None:
        """A naive time means UTC; the instant must lie between EARLIEST and LATEST."""
        if at is None:
            return None
        at = at if at.tzinfo else at.replace(tzinfo=UTC)
        if not EARLIEST <= at <= LATEST:  # aware datetimes compare as instants, whatever their offset
            raise PydanticCustomError("datetime_range", "must lie between {earliest} and {latest}",
                                      {"earliest": f"{EARLIEST:%Y-%m-%dT%H:%M:%SZ}",
                                       "latest": f"{LATEST:%Y-%m-%dT%H:%M:%SZ}"})
        return at

    def to_new(self, *, default_max_attempts: int) -> NewTask:
        available = None if self.available_at is None else self.available_at.timestamp()
        return NewTask(self.type, self.payload, self.priority, self.max_attempts or default_max_attempts,
                       self.timeout_s, tuple(sorted(set(self.required_tags))), self.idempotency_key, available)


class SubmitBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: list[SubmitTask] = Field(min_length=1, max_length=10_000)


class PoolPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_workers: int | None = Field(None, ge=1, le=MAX_WORKERS)  # as pool.min_workers
    max_workers: int | None = Field(None, ge=1, le=MAX_WORKERS)
    idle_timeout_s: float | None = Field(None, gt=0)


class ScheduleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=MAX_NAME_LEN, pattern=NAME_PATTERN)
    type: str = Field(min_length=1, max_length=200)
    payload: dict[str, Any] = {}
    cron: str | None = Field(None, max_length=200)
    every_s: float | None = Field(None, ge=1.0, le=366 * 86400)  # sub-second periods overflow the tick arithmetic
    timezone: str = Field("UTC", max_length=100)
    jitter_s: float = Field(0.0, ge=0, le=86400)
    catch_up: Literal["none", "last", "all"] = "last"
    overlap: Literal["allow", "skip"] = "allow"
    priority: int = Field(0, ge=-1_000_000, le=1_000_000)

    def to_schedule(self) -> Schedule:
        return Schedule(**self.model_dump())


class ScheduleOut(BaseModel):
    name: str
    type: str
    payload: dict[str, Any]
    cron: str | None
    every_s: float | None
    timezone: str
    jitter_s: float
    catch_up: str
    overlap: str
    priority: int
    config_node: str | None = Field(description="the node whose config file defines it (removing it there "
                                                "removes it); null: defined through the API")
    paused: bool
    next_run_at: str | None
    last_run_at: str | None
    last_task_id: str | None
    last_task_state: str | None


class SchedulesOut(BaseModel):
    schedules: list[ScheduleOut]


class NodeOut(BaseModel):
    """A node of the fleet as the registry holds it; `alive`: heard from within three of its heartbeats."""

    node_id: str
    instance_id: str
    hostname: str
    pid: int
    version: str
    started_at: str
    heartbeat_at: str
    alive: bool
    stopped_at: str | None
    task_types: list[str]
    tags: list[list[str]] = Field(description="the tag set of each of the node's resources")
    max_workers: int


class NodesOut(BaseModel):
    nodes: list[NodeOut]


def attempt_json(a: Attempt) -> dict[str, Any]:
    return {"id": a.id, "number": a.number, "node_id": a.node_id, "worker_id": a.worker_id,
            "status": a.status.value, "started_at": rfc3339(a.started_at), "finished_at": rfc3339(a.finished_at),
            "error": None if a.error is None else a.error.to_json(), "exit_status": a.exit_status,
            "stderr_tail": a.stderr_tail}


# An attempt that ended so did not produce the task's results, whatever its plugins marked final before it
# failed: a task retried to success shows the final results of the attempt that succeeded, once each.
_UNSUCCESSFUL = frozenset({AttemptStatus.FAILED, AttemptStatus.TIMED_OUT, AttemptStatus.EXPIRED,
                           AttemptStatus.CANCELLED, AttemptStatus.INTERRUPTED})


def result_json(r: ResultBatch, *, attempt_ended_unsuccessfully: bool = False) -> dict[str, Any]:
    return {"plugin": r.plugin, "sequence": r.sequence, "idempotency_key": r.idempotency_key,
            "sha256": r.sha256, "final": r.final and not attempt_ended_unsuccessfully, "attempt_id": r.attempt_id,
            "payload": r.payload}


def task_json(t: Task, *, results: bool = True) -> dict[str, Any]:
    body = {
        "id": t.id, "type": t.type, "payload": t.payload, "priority": t.priority, "state": t.state.value,
        "phase": None if t.phase is None else t.phase.value, "progress": t.progress, "attempt": t.attempt,
        "max_attempts": t.max_attempts, "timeout_s": t.timeout_s, "required_tags": list(t.required_tags),
        "idempotency_key": t.idempotency_key, "node_id": t.node_id,
        "error": None if t.error is None else t.error.to_json(), "created_at": rfc3339(t.created_at),
        "updated_at": rfc3339(t.updated_at), "available_at": rfc3339(t.available_at),
        "finished_at": rfc3339(t.finished_at), "attempts": [attempt_json(a) for a in t.attempts],
    }
    if results:
        unsuccessful = {a.id for a in t.attempts if a.status in _UNSUCCESSFUL}
        body["results"] = [result_json(r, attempt_ended_unsuccessfully=r.attempt_id in unsuccessful)
                           for r in t.results]
    return body


# Response shapes: the OpenAPI document is generated from these and from the request models above.


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorOut(BaseModel):
    error: ErrorBody


class TaskErrorOut(BaseModel):
    code: str
    message: str


class AttemptOut(BaseModel):
    id: str
    number: int
    node_id: str
    worker_id: str
    status: str
    started_at: str
    finished_at: str | None
    error: TaskErrorOut | None
    exit_status: int | None
    stderr_tail: str | None


class ResultOut(BaseModel):
    plugin: str
    sequence: int
    idempotency_key: str
    sha256: str
    final: bool  # false, whatever the plugin said, once its attempt ended without succeeding
    attempt_id: str
    payload: Any


class TaskOut(BaseModel):
    id: str
    type: str
    payload: dict[str, Any]
    priority: int
    state: str
    phase: str | None
    progress: dict[str, Any] | None
    attempt: int
    max_attempts: int
    timeout_s: float | None
    required_tags: list[str]
    idempotency_key: str | None
    node_id: str | None
    error: TaskErrorOut | None
    created_at: str
    updated_at: str
    available_at: str
    finished_at: str | None
    attempts: list[AttemptOut]
    results: list[ResultOut] = []


class PageOut(BaseModel):
    tasks: list[TaskOut]
    next_cursor: str | None


class IdsOut(BaseModel):
    ids: list[str]


class StateOut(BaseModel):
    state: str


class RetryOut(BaseModel):
    state: str
    task: TaskOut


class PoolOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    node_id: str
    min_workers: int
    max_workers: int
    idle_timeout_s: float
    workers: int
    busy: int
    baseline: int
    demand: int
    queue: dict[str, int]
    guards: dict[str, Any]
    pending_restart: list[str]


class HealthOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: str


class EventOut(BaseModel):
    """One server-sent event of GET /v1/events; `data` is the event's JSON, `id` absent on stream.* notices."""

    event: str
    data: str
    id: str | None = None
