"""Answers: the response bodies both servers write, each read from a domain object's attributes, and the ones
both answer with: a task (the API's task routes, the gateway's leases) and the error body.

A model is built from the domain object (`TaskOut.of(task)`) and written with `to_json()`; the OpenAPI
document is generated from these same models, so the two cannot drift.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Annotated, Any, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ..model import AttemptStatus, Phase, State, Task, rfc3339

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# An instant: epoch seconds in the domain, RFC 3339 in UTC with microseconds on the wire.
Instant = Annotated[str, BeforeValidator(rfc3339)]


class Answer(BaseModel):
    """A response body, read from a domain object's attributes."""

    model_config = ConfigDict(from_attributes=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def attributes(data: DataclassInstance) -> dict[str, Any]:
    """A dataclass's fields by name, for an answer that adds what the object does not hold itself."""
    return {f.name: getattr(data, f.name) for f in fields(data)}


class ErrorBody(Answer):
    """Why a request was refused: `code` for programs, `message` (naming the field) for people."""

    code: str
    message: str


class ErrorOut(Answer):
    error: ErrorBody


class TaskErrorOut(Answer):
    """How a task or one of its attempts failed."""

    code: str
    message: str


class AttemptOut(Answer):
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
    deadline_at: Instant | None = Field(description="set when its run phase started (its run timeout + "
                                        "execution.stop_timeout_s + one lease later): past it the store takes none "
                                        "of its writes and the reconciler ends it timed_out")


class ResultOut(Answer):
    plugin: str
    sequence: int
    idempotency_key: str
    sha256: str
    final: bool = Field(description="false, whatever the plugin said, once its attempt ended without succeeding")
    attempt_id: str
    payload: Any


class ArtifactOut(Answer):
    """A file an attempt recorded; its bytes are GET /v1/tasks/{id}/artifacts/{name}."""

    name: str
    sha256: str
    size: int
    content_type: str | None
    attempt_id: str
    created_at: Instant


class TaskOut(Answer):
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
    inputs: dict[str, str] = Field(description="as submitted: file name -> sha256 of its blob")
    artifacts: list[ArtifactOut] = Field(description="every attempt's, oldest first")

    @classmethod
    def of(cls, task: Task) -> Self:
        shown = cls.model_validate(task)
        unsuccessful = {a.id for a in task.attempts if a.status in _UNSUCCESSFUL}
        for result in shown.results:
            result.final = result.final and result.attempt_id not in unsuccessful
        return shown
