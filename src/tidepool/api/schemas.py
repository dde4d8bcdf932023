"""The HTTP API's bodies: what a request may carry, and the one JSON shape of each resource it answers with.

The response models are built from the domain objects (`TaskOut.of(task)`) and written with `to_json()`;
the OpenAPI document is generated from these same models, so the two cannot drift.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError

from ..execution.guards import GuardStats
from ..execution.resources import ResourceStats
from ..model import (
    DEFAULT_ORGANIZATION,
    ORGANIZATION_PATTERN,
    AttemptStatus,
    NewTask,
    Phase,
    RemoteWorker,
    State,
    Task,
    WorkerState,
    rfc3339,
)
from ..scans import ScanState
from ..schedules import MAX_NAME_LEN, NAME_PATTERN, CatchUp, Overlap, Schedule
from ..settings import MAX_WORKERS, Tag
from ..store import Node

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from ..execution.pool import PoolStats

MAX_LIST_LIMIT = 1000
CURSOR_PATTERN = r"^([0-9a-f]{32})?$"  # a next_cursor is a task id (model.new_id); empty is the first page
# The instants the task JSON can show: model.rfc3339 writes years below 1000 with fewer than four digits, and
# a float epoch within microseconds of year 10000 rounds up into it.
EARLIEST = datetime(1000, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)


def _integral(value: object) -> object:
    """A JSON number with nothing after the point is an integer (JSON Schema says so, and so does the document):
    -1784.0 is taken as -1784; 1.5 and true are still refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer as JSON Schema counts one. Strict validation alone would refuse 3.0, which the document allows.
JsonInt = Annotated[int, BeforeValidator(_integral)]


class NoFields(BaseModel):
    """The body of a route that takes none, when one is sent anyway: {} and nothing more."""

    model_config = ConfigDict(extra="forbid")


class SubmitTask(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # default_factory: a literal {} or [] default is deep-copied for every task of a batch (measured: 8%
    # of a 2,000-task submit).
    type: str = Field(min_length=1, max_length=200)
    payload: dict[str, Any] = Field(default_factory=dict)
    priority: JsonInt = Field(0, ge=-1_000_000, le=1_000_000)
    max_attempts: JsonInt | None = Field(None, ge=1, le=1000)
    timeout_s: float | None = Field(None, gt=0, le=7 * 86400)
    required_tags: list[Tag] = Field(default_factory=list, max_length=64)
    idempotency_key: str | None = Field(None, min_length=1, max_length=512, pattern=r"^[^\x00]*$")  # no NUL
    available_at: datetime | None = None
    organization: str = Field(DEFAULT_ORGANIZATION, pattern=ORGANIZATION_PATTERN,
                              description="whose task it is: a remote worker takes only the organizations it is "
                                          "assigned (a node's own workers take every one)")

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
                       self.timeout_s, tuple(sorted(set(self.required_tags))), self.idempotency_key, available,
                       self.organization)


class SubmitBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: list[SubmitTask] = Field(min_length=1, max_length=10_000)


class PoolPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_workers: JsonInt | None = Field(None, ge=1, le=MAX_WORKERS)  # as pool.min_workers
    max_workers: JsonInt | None = Field(None, ge=1, le=MAX_WORKERS)
    idle_timeout_s: float | None = Field(None, gt=0)


# A schedule runs by exactly one of its two timings, and submits a task of its type or starts a scan of its
# profile; the other of each pair is left out or null.
_ONE_TIMING: JsonDict = {"allOf": [
    {"oneOf": [{"required": ["cron"], "properties": {"cron": {"type": "string"}}},
               {"required": ["every_s"], "properties": {"every_s": {"type": "number"}}}]},
    {"oneOf": [{"required": ["type"], "properties": {"type": {"type": "string"}}},
               {"required": ["profile"], "properties": {"profile": {"type": "string"}}}]}]}


class ScheduleIn(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_ONE_TIMING)

    name: str = Field(min_length=1, max_length=MAX_NAME_LEN, pattern=NAME_PATTERN)
    type: str | None = Field(None, min_length=1, max_length=200)
    profile: str | None = Field(None, min_length=1, max_length=200, description="start a scan of this profile "
                                "at each tick, instead of a task of `type`")
    payload: dict[str, Any] = {}
    cron: str | None = Field(None, max_length=200)
    every_s: float | None = Field(None, ge=1.0, le=366 * 86400)  # sub-second periods overflow the tick arithmetic
    timezone: str = Field("UTC", max_length=100)
    jitter_s: float = Field(0.0, ge=0, le=86400)
    catch_up: CatchUp = "last"
    overlap: Overlap = "allow"
    priority: JsonInt = Field(0, ge=-1_000_000, le=1_000_000)

    def to_schedule(self) -> Schedule:
        return Schedule(**self.model_dump())


# Responses: each resource's one JSON shape.

# An instant: epoch seconds in the domain, RFC 3339 in UTC with microseconds on the wire.
Instant = Annotated[str, BeforeValidator(rfc3339)]


class Shape(BaseModel):
    """A response body, read from a domain object's attributes."""

    model_config = ConfigDict(from_attributes=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _attributes(data: DataclassInstance) -> dict[str, Any]:
    """A dataclass's fields by name, for a shape that adds what the object does not hold itself."""
    return {f.name: getattr(data, f.name) for f in fields(data)}


class ErrorBody(Shape):
    """Why a request was refused: `code` for programs, `message` (naming the field) for people."""

    code: str
    message: str


class ErrorOut(Shape):
    error: ErrorBody


class TaskErrorOut(Shape):
    """How a task or one of its attempts failed."""

    code: str
    message: str


class AttemptOut(Shape):
    id: str
    number: int
    node_id: str
    worker_id: str
    status: AttemptStatus
    started_at: Instant
    finished_at: Instant | None
    error: TaskErrorOut | None
    exit_status: int | None
    stderr_tail: str | None


class ResultOut(Shape):
    plugin: str
    sequence: int
    idempotency_key: str
    sha256: str
    final: bool = Field(description="false, whatever the plugin said, once its attempt ended without succeeding")
    attempt_id: str
    payload: Any


class TaskOut(Shape):
    """A task as listings show it: without its results."""

    id: str
    type: str
    organization: str
    payload: dict[str, Any]
    priority: int
    state: State
    phase: Phase | None = Field(description="of its running attempt, written behind while it runs")
    progress: dict[str, Any] | None = Field(description="the last progress its plugins reported")
    attempt: int = Field(description="attempts started (interruptions by a shutdown do not use one)")
    max_attempts: int
    timeout_s: float | None = Field(description="per attempt; null: its type's timeout_s, else execution.timeout_s")
    required_tags: list[str]
    idempotency_key: str | None
    node_id: str | None
    error: TaskErrorOut | None
    created_at: Instant
    updated_at: Instant
    available_at: Instant
    finished_at: Instant | None
    attempts: list[AttemptOut]

    @classmethod
    def of(cls, task: Task) -> Self:
        return cls.model_validate(task)


# An attempt that ended so did not produce the task's results, whatever its plugins marked final before it
# failed: a task retried to success shows the final results of the attempt that succeeded, once each.
_UNSUCCESSFUL = frozenset({AttemptStatus.FAILED, AttemptStatus.TIMED_OUT, AttemptStatus.EXPIRED,
                           AttemptStatus.CANCELLED, AttemptStatus.INTERRUPTED})


class TaskDetailOut(TaskOut):
    """A task with its results, as GET /v1/tasks/{id} and a submit answer it."""

    results: list[ResultOut]

    @classmethod
    def of(cls, task: Task) -> Self:
        shown = cls.model_validate(task)
        unsuccessful = {a.id for a in task.attempts if a.status in _UNSUCCESSFUL}
        for result in shown.results:
            result.final = result.final and result.attempt_id not in unsuccessful
        return shown


class PageOut(Shape):
    tasks: list[TaskOut]
    next_cursor: str | None


class IdsOut(Shape):
    ids: list[str]


class StateOut(Shape):
    state: State


class RetryOut(Shape):
    state: State
    task: TaskOut


class GuardsOut(Shape):
    tripped: list[str] = Field(description="the guards below their floor: memory, disk")
    min_free_memory_mb: int
    min_free_disk_mb: int
    free_memory_mb: int | None = Field(description="null until measured, or when the probe failed")
    free_disk_mb: int | None


class ResourceOut(Shape):
    in_use: int
    count: int
    tags: list[str]


class PoolOut(Shape):
    node_id: str
    min_workers: int
    max_workers: int
    idle_timeout_s: float
    workers: int
    busy: int = Field(description="workers running a task")
    baseline: int = Field(description="workers that never retire (min_workers of them)")
    demand: int = Field(description="workers started for a busy pool, retired after idle_timeout_s")
    claiming: bool = Field(description="false while draining or while a host guard is tripped")
    draining: bool
    queue: dict[str, int] = Field(description="tasks by unfinished state, in the whole store")
    guards: GuardsOut
    resources: dict[str, ResourceOut]
    pending_restart: list[str] = Field(description="settings changed by a reload that apply at the next start")

    @classmethod
    def of(cls, stats: PoolStats, *, node_id: str, draining: bool, queue: Mapping[str, int], guards: GuardStats,
           resources: Mapping[str, ResourceStats], pending_restart: list[str]) -> Self:
        return cls.model_validate({**_attributes(stats), "node_id": node_id, "draining": draining, "queue": queue,
                                   "guards": guards, "resources": resources, "pending_restart": pending_restart})


class ScheduleOut(Shape):
    name: str
    type: str | None
    profile: str | None = Field(description="a profile schedule starts a scan of it at each tick (type is null)")
    payload: dict[str, Any]
    cron: str | None
    every_s: float | None
    timezone: str
    jitter_s: float
    catch_up: CatchUp
    overlap: Overlap
    priority: int
    config_node: str | None = Field(description="the node whose config file defines it (removing it there "
                                                "removes it); null: defined through the API")
    paused: bool
    next_run_at: Instant | None
    last_run_at: Instant | None
    last_task_id: str | None
    last_task_state: State | None = Field(description="null when it made no task yet, or that task was pruned")
    last_scan_id: str | None = Field(description="a profile schedule's last scan (last_task_id is null then)")
    last_scan_state: ScanState | None = Field(description="null when it started no scan yet, or it was pruned")

    @classmethod
    def of(cls, schedule: Schedule, *, last_task_state: State | None = None,
           last_scan_state: ScanState | None = None) -> Self:
        fields = _attributes(schedule)
        if schedule.profile is not None:  # the id a profile schedule keeps of the last thing it started is a scan's
            fields.update(last_task_id=None, last_scan_id=schedule.last_task_id)
        return cls.model_validate({"last_scan_id": None, **fields, "last_task_state": last_task_state,
                                   "last_scan_state": last_scan_state})


class SchedulesOut(Shape):
    schedules: list[ScheduleOut]


class NodeOut(Shape):
    """A node of the fleet as the registry holds it; `alive`: heard from within three of its heartbeats."""

    node_id: str
    instance_id: str
    hostname: str
    pid: int
    version: str
    started_at: Instant
    heartbeat_at: Instant
    alive: bool
    stopped_at: Instant | None
    task_types: list[str]
    tags: list[list[str]] = Field(description="the tag set of each of the node's resources")
    max_workers: int
    kind: Literal["node", "remote"] = Field("node", description="remote: a worker a gateway serves (its "
                                            "max_workers is its max_concurrent_tasks, its heartbeat its last call)")

    @classmethod
    def of(cls, node: Node, *, now: float) -> Self:
        return cls.model_validate({**_attributes(node), "alive": node.alive(now)})

    @classmethod
    def of_remote(cls, worker: RemoteWorker, *, now: float, heard_within_s: float) -> Self:
        """A remote worker beside the nodes: alive while served and heard from within `heard_within_s`."""
        alive = worker.state in (WorkerState.ENABLED, WorkerState.DISABLED) and now - worker.last_seen <= heard_within_s
        return cls.model_validate({
            "node_id": worker.id, "instance_id": "", "hostname": worker.address or "", "pid": 0,
            "version": worker.version or "", "started_at": worker.first_seen, "heartbeat_at": worker.last_seen,
            "alive": alive, "stopped_at": None, "task_types": list(worker.task_types),
            "tags": [list(s) for s in worker.slots], "max_workers": worker.max_concurrent_tasks, "kind": "remote"})


class NodesOut(Shape):
    nodes: list[NodeOut]


class HealthOut(Shape):
    status: str = Field(description="ok (healthz); ready, or unavailable with a reason (readyz)")
    reason: str | None = Field(None, description="why the node is not ready")


class EventOut(Shape):
    """One server-sent event of GET /v1/events; `data` is the event's JSON, `id` absent on stream.* notices."""

    event: str
    data: str
    id: str | None = None
