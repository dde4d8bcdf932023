"""The OpenAPI 3.1 document of the API, generated from the pydantic models that validate it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .. import __version__
from .schemas import (
    ErrorOut,
    EventOut,
    HealthOut,
    IdsOut,
    NodesOut,
    PageOut,
    PoolOut,
    PoolPatch,
    RetryOut,
    ScheduleIn,
    ScheduleOut,
    SchedulesOut,
    StateOut,
    SubmitBatch,
    SubmitTask,
    TaskOut,
)

MODELS: list[type[BaseModel]] = [SubmitTask, SubmitBatch, PoolPatch, TaskOut, PageOut, IdsOut, StateOut,
                                 RetryOut, PoolOut, ErrorOut, HealthOut, EventOut, ScheduleIn, ScheduleOut,
                                 SchedulesOut, NodesOut]
ERRORS = {"400": "invalid input, naming the field", "401": "missing or wrong bearer token",
          "403": "a change asked from another origin, or (without a token) a Host that is not a loopback name",
          "404": "no such task", "409": "conflicts with the task's state, an earlier submit or the node's (draining)",
          "413": "body over api.max_body_kb", "415": "body is not application/json",
          "429": "queue over pool.max_queued", "503": "store unavailable"}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": _ref(model)}}}


def _op(summary: str, ok: dict[str, type[BaseModel]], *, body: type[BaseModel] | None = None,
        errors: tuple[str, ...] = (), params: list[dict[str, Any]] | None = None,
        auth: bool = True) -> dict[str, Any]:
    responses: dict[str, Any] = {code: {"description": summary, **_json(model)} for code, model in ok.items()}
    for code in (*errors, "403", *(("401",) if auth else ())):
        responses[code] = {"description": ERRORS[code], **_json(ErrorOut)}
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": True, **_json(body)}
    if params:
        op["parameters"] = params
    if not auth:
        op["security"] = []
    return op


def _param(name: str, where: str, schema: dict[str, Any], *, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": where, "required": required, "schema": schema}


TASK_ID = _param("id", "path", {"type": "string"}, required=True)
EVENT_TYPES = {**_param("type", "query", {"type": "array", "items": {"type": "string"}}), "style": "form",
               "explode": True, "description": "event names or globs, repeated or comma-separated"}
NAME = _param("name", "path", {"type": "string"}, required=True)


def document(*, task_types: Sequence[str] = ()) -> dict[str, Any]:
    """The document; `task_types` (the node's known types, from its config) become the enum of a task's type."""
    _, defs = models_json_schema([(m, "validation") for m in MODELS], ref_template="#/components/schemas/{model}")
    if task_types:
        defs["$defs"]["SubmitTask"]["properties"]["type"]["enum"] = list(task_types)
    listing = [_param("state", "query", {"type": "string", "enum": [
                   "pending", "leased", "running", "retry_wait", "cancelling", "completed", "failed",
                   "timed_out", "cancelled"]}),
               _param("type", "query", {"type": "string"}),
               _param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 1000}),
               _param("cursor", "query", {"type": "string"})]
    paths = {
        "/v1/tasks": {
            "post": _op("submit a task", {"201": TaskOut, "200": TaskOut}, body=SubmitTask,
                        errors=("400", "409", "413", "415", "429", "503")),
            "get": _op("list tasks, newest first", {"200": PageOut}, errors=("400", "503"), params=listing),
        },
        "/v1/tasks/batch": {"post": _op("submit tasks in one transaction (200: every one existed already)",
                                        {"201": IdsOut, "200": IdsOut}, body=SubmitBatch,
                                        errors=("400", "409", "413", "415", "429", "503"))},
        "/v1/tasks/{id}": {"get": _op("a task with attempts and results", {"200": TaskOut},
                                      errors=("404", "503"), params=[TASK_ID])},
        # no body; one asking for anything is refused (400, 413, 415)
        "/v1/tasks/{id}/cancel": {"post": _op("cancel a task", {"202": StateOut},
                                              errors=("400", "404", "409", "413", "415", "503"), params=[TASK_ID])},
        "/v1/tasks/{id}/retry": {"post": _op("retry a finished task", {"202": RetryOut},
                                             errors=("400", "404", "409", "413", "415", "429", "503"),
                                             params=[TASK_ID])},
        "/v1/pool": {
            "get": _op("pool and queue figures", {"200": PoolOut}, errors=("503",)),
            "patch": _op("change pool sizes live", {"200": PoolOut}, body=PoolPatch,
                         errors=("400", "409", "413", "415", "503")),
        },
        "/v1/nodes": {"get": _op("nodes sharing the store, with liveness", {"200": NodesOut}, errors=("503",))},
        "/v1/schedules": {
            "get": _op("schedules with next/last run", {"200": SchedulesOut}, errors=("503",)),
            "post": _op("create or update a schedule", {"201": ScheduleOut}, body=ScheduleIn,
                        errors=("400", "413", "415", "503")),
        },
        "/v1/schedules/{name}": {"delete": {**_op("delete a schedule", {}, errors=("404", "503"), params=[NAME]),
                                            "responses": {"204": {"description": "deleted"},
                                                          "404": {"description": ERRORS["404"], **_json(ErrorOut)},
                                                          "401": {"description": ERRORS["401"], **_json(ErrorOut)},
                                                          "403": {"description": ERRORS["403"], **_json(ErrorOut)},
                                                          "503": {"description": ERRORS["503"], **_json(ErrorOut)}}}},
        "/v1/schedules/{name}/pause": {"post": _op("pause a schedule", {"200": ScheduleOut}, errors=("404", "503"),
                                                   params=[NAME])},
        "/v1/schedules/{name}/resume": {"post": _op("resume a schedule at its next tick", {"200": ScheduleOut},
                                                    errors=("404", "503"), params=[NAME])},
        "/v1/events": {"get": {"summary": "server-sent events; Last-Event-ID resumes",
                               "parameters": [_param("task_id", "query", {"type": "string"}), EVENT_TYPES,
                                              _param("Last-Event-ID", "header", {"type": "string",
                                                                                 "pattern": "^[0-9]{0,20}$"})],
                               "responses": {"200": {"description": "text/event-stream",
                                                     "content": {"text/event-stream": {"schema": _ref(EventOut)}}},
                                             **{code: {"description": ERRORS[code], **_json(ErrorOut)}
                                                for code in ("400", "401", "403", "404", "503")}}}},
        "/healthz": {"get": _op("the process answers", {"200": HealthOut}, auth=False)},
        "/readyz": {"get": _op("ready to work", {"200": HealthOut, "503": HealthOut}, auth=False)},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "tidepool", "version": __version__,
                 "description": "The HTTP API of a tidepool node: tasks, pool, events."},
        "paths": paths,
        "components": {"schemas": defs["$defs"],
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
