"""The /v1/tasks routes: submit (one or a batch), list, get, cancel and retry; the bodies a submit may carry and
the answers of each."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from ..errors import TaskNotFound
from ..http.answers import Answer, TaskDetailOut, TaskOut
from ..http.bodies import JsonInt, integral, no_body, parse
from ..http.refusals import Refusal
from ..model import DEFAULT_ORGANIZATION, ORGANIZATION_PATTERN, NewTask, State
from ..settings import Tag
from .blobs import checked_inputs, inputs_field
from .listing import cursor_of, limit_of, one_each
from .operations import DAEMON

LIST_PARAMETERS = ("state", "type", "limit", "cursor", "organization")
# The instants the task JSON can show: model.rfc3339 writes years below 1000 with fewer than four digits, and
# a float epoch within microseconds of year 10000 rounds up into it.
EARLIEST = datetime(1000, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)


class SubmitTask(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # default_factory: a literal {} or [] default is deep-copied for every task of a batch (measured: 8%
    # of a 2,000-task submit).
    type: str = Field(min_length=1, max_length=200)
    payload: dict[str, Any] = Field(default_factory=dict)
    priority: JsonInt = Field(0, ge=-1_000_000, le=1_000_000)
    max_attempts: Annotated[int, Field(ge=1, le=1000), BeforeValidator(integral)] | None = None
    timeout_s: float | None = Field(None, gt=0, le=7 * 86400)
    required_tags: list[Tag] = Field(default_factory=list, max_length=64)
    idempotency_key: str | None = Field(None, min_length=1, max_length=512, pattern=r"^[^\x00]*$")  # no NUL
    # A four-digit year: the document's way of saying EARLIEST..LATEST (a time zone may still push it past them).
    available_at: datetime | None = Field(None, json_schema_extra={"pattern": r"^[1-9][0-9]{3}-"})
    organization: str = Field(DEFAULT_ORGANIZATION, pattern=ORGANIZATION_PATTERN,
                              description="whose task it is: a remote worker takes only the organizations it is "
                                          "assigned (a node's own workers take every one)")
    inputs: dict[str, str] = inputs_field()

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

    def to_new(self, *, default_max_attempts: int, field: str = "inputs") -> NewTask:
        """`field`: what a bad input is named by (a batch's task says which it is)."""
        available = None if self.available_at is None else self.available_at.timestamp()
        return NewTask(self.type, self.payload, self.priority, self.max_attempts or default_max_attempts,
                       self.timeout_s, tuple(sorted(set(self.required_tags))), self.idempotency_key, available,
                       self.organization, checked_inputs(self.inputs, field))


class SubmitBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: list[SubmitTask] = Field(min_length=1, max_length=10_000)


class PageOut(Answer):
    tasks: list[TaskOut]
    next_cursor: str | None


class IdsOut(Answer):
    ids: list[str]


class StateOut(Answer):
    state: State


class RetryOut(Answer):
    state: State
    task: TaskOut


async def submit(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    body = await parse(request, SubmitTask)
    task, created = await daemon.submit(body.to_new(default_max_attempts=daemon.max_attempts_for(body.type)))
    return web.json_response(TaskDetailOut.of(task).to_json(), status=201 if created else 200)


async def submit_batch(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    body = await parse(request, SubmitBatch)
    news = [t.to_new(default_max_attempts=daemon.max_attempts_for(t.type), field=f"tasks.{i}.inputs")
            for i, t in enumerate(body.tasks)]
    added = await daemon.submit_many(news)
    # 200 for a batch resubmitted whole (every task found by its idempotency_key), as a single submit
    return web.json_response({"ids": [task_id for task_id, _ in added]},
                             status=201 if any(created for _, created in added) else 200)


async def batch_only(request: web.Request) -> web.Response:
    """/v1/tasks/batch answers POST; a GET looks for a task of that id, as any other (there is none: 404)."""
    if request.method in ("GET", "HEAD"):
        raise TaskNotFound("batch")
    if request.method != "POST":
        raise web.HTTPMethodNotAllowed(request.method, ["POST"])
    return await submit_batch(request)


async def get_task(request: web.Request) -> web.Response:
    task = await request.app[DAEMON].get(request.match_info["id"])
    return web.json_response(TaskDetailOut.of(task).to_json())


async def list_tasks(request: web.Request) -> web.Response:
    q = one_each(request, LIST_PARAMETERS)
    state = None
    if "state" in q:  # present but empty is not "no filter": the document lists the states
        try:
            state = State(q["state"])
        except ValueError:
            raise Refusal(400, "invalid_request", f"state: unknown state {q['state']!r}") from None
    if q.get("type") == "":
        raise Refusal(400, "invalid_request", "type: empty; leave the parameter out to list every type")
    limit, cursor = limit_of(q), cursor_of(q)
    organization = q.get("organization")
    if organization is not None and not re.fullmatch(ORGANIZATION_PATTERN, organization):
        raise Refusal(400, "invalid_request", f"organization: {organization!r} is not an organization name: 1 to 64 "
                                              "of the characters A-Z a-z 0-9 . _ -")
    page = await request.app[DAEMON].list_tasks(state=state, type=q.get("type"), limit=limit, cursor=cursor,
                                                organization=organization)
    return web.json_response({"tasks": [TaskOut.of(t).to_json() for t in page.tasks],
                              "next_cursor": page.next_cursor})


async def cancel(request: web.Request) -> web.Response:
    await no_body(request)
    state = await request.app[DAEMON].cancel(request.match_info["id"])
    return web.json_response({"state": state.value}, status=202)


async def retry(request: web.Request) -> web.Response:
    await no_body(request)
    task = await request.app[DAEMON].retry(request.match_info["id"])
    return web.json_response({"state": task.state.value, "task": TaskOut.of(task).to_json()}, status=202)
