"""The OpenAPI 3.1 document of the API: the node's routes, each described by the pydantic models that validate
its requests and shape its answers, and a bearer scheme only on a node that has a token."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from .. import __version__
from ..gateway import schemas as w1
from ..model import ORGANIZATION_PATTERN, State
from ..scans import ScanState
from .scans import ScanOut, ScanPageOut, ScanStateOut, SubmitScan
from .schemas import (
    CURSOR_PATTERN,
    MAX_LIST_LIMIT,
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
    TaskDetailOut,
)
from .workers import WorkerOut, WorkerPatch, WorkersOut

ERRORS = {"400": "invalid input, naming the field", "401": "missing or wrong bearer token",
          "403": "a change asked from another origin, or (without a token) a Host that is not a loopback name",
          "404": "no such task, schedule or scan", "408": "the body did not arrive in time",
          "409": "conflicts with the task's or scan's state, an earlier submit or the node's (draining)",
          "413": "body over api.max_body_kb", "415": "body is not application/json",
          "429": "queue over pool.max_queued", "503": "store unavailable, or too many event streams",
          "410": "the lease is gone (error.reason: expired, cancelled, revoked, superseded)"}
W1_ERRORS = {"403": "the registry refuses the worker (worker_pending, worker_revoked) or its certificate names no one"}
W1_TAG = "worker protocol"
# The worker protocol is served on gateway.listen (mutual TLS: the client certificate is the worker's identity),
# not beside /v1: each of its paths names that server.
W1_SERVERS = [{"url": "https://{gateway}", "description": "gateway.listen; a client certificate of "
               "gateway.client_ca_file is required", "variables": {"gateway": {"default": "localhost:8471"}}}]
BODY_ERRORS = ("400", "408", "413", "415")
# Routes the document leaves out: the dashboard, its files, the metrics text and the document itself.
UNDOCUMENTED = frozenset({"/", "/static", "/metrics", "/v1/openapi.json"})


def _param(name: str, where: str, schema: dict[str, Any], *, required: bool = False,
           **more: Any) -> dict[str, Any]:
    return {"name": name, "in": where, "required": required, "schema": schema, **more}


TASK_ID = _param("id", "path", {"type": "string"}, required=True)
WORKER_ID = _param("id", "path", {"type": "string"}, required=True,
                   description="the worker's identity: its certificate's common name")
NAME = _param("name", "path", {"type": "string"}, required=True)
EVENT_ID = {"type": "string", "pattern": "^[0-9]{0,20}$"}
LISTING = (_param("state", "query", {"type": "string", "enum": [s.value for s in State]}),
           _param("type", "query", {"type": "string", "minLength": 1}),
           _param("limit", "query", {"type": "integer", "minimum": 1, "maximum": MAX_LIST_LIMIT}),
           _param("organization", "query", {"type": "string", "pattern": ORGANIZATION_PATTERN}),
           _param("cursor", "query", {"type": "string", "pattern": CURSOR_PATTERN},
                  description="the next_cursor of the page before"))
SCAN_ID = _param("id", "path", {"type": "string"}, required=True)
JOB_INDEX = _param("index", "path", {"type": "integer", "minimum": 0}, required=True)
SCAN_LISTING = (_param("state", "query", {"type": "string", "enum": [s.value for s in ScanState]}),
                _param("profile", "query", {"type": "string", "minLength": 1}),
                *(p for p in LISTING if p["name"] in ("limit", "cursor")))
EVENTS = (_param("task_id", "query", {"type": "string"}),
          _param("type", "query", {"type": "array", "items": {"type": "string"}}, style="form", explode=True,
                 description="event names or globs, repeated or comma-separated"),
          _param("last_event_id", "query", EVENT_ID, description="as Last-Event-ID, for clients that cannot set it"),
          _param("Last-Event-ID", "header", EVENT_ID))


@dataclass(frozen=True)
class Operation:
    id: str                     # its operationId
    summary: str
    ok: Mapping[str, type[BaseModel] | None]  # status -> the answer's model (None: no body)
    errors: tuple[str, ...] = ()
    body: type[BaseModel] | None = None
    params: Sequence[dict[str, Any]] = ()
    open: bool = False          # answered without the token
    route: str | None = None    # the router's path, when one route serves several documented paths
    media: str = "application/json"
    # a field of the answer -> the operations that take it as their parameter of that name
    links: Mapping[str, Sequence[str]] = field(default_factory=dict)
    tag: str | None = None      # the worker protocol's operations are tagged apart


def _schedule_action(name: str, summary: str) -> Operation:
    return Operation(name, summary, {"200": ScheduleOut}, ("404", "503"), params=[NAME],
                     route="/v1/schedules/{name}/{action}")


SUBMIT_ERRORS = (*BODY_ERRORS, "409", "429", "503")
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("post", "/v1/tasks"): Operation(
        "submitTask", "submit a task (200: its idempotency_key found it submitted already)",
        {"201": TaskDetailOut, "200": TaskDetailOut}, SUBMIT_ERRORS, body=SubmitTask,
        links={"id": ("getTask", "cancelTask", "retryTask")}),
    ("get", "/v1/tasks"): Operation(
        "listTasks", "list tasks, newest first", {"200": PageOut}, ("400", "503"), params=LISTING),
    ("post", "/v1/tasks/batch"): Operation(
        "submitBatch", "submit tasks in one transaction (200: every one existed already)",
        {"201": IdsOut, "200": IdsOut}, SUBMIT_ERRORS, body=SubmitBatch),
    ("get", "/v1/tasks/{id}"): Operation(
        "getTask", "a task with attempts and results", {"200": TaskDetailOut}, ("404", "503"), params=[TASK_ID]),
    # no body; one asking for anything is refused (400, 413, 415)
    ("post", "/v1/tasks/{id}/cancel"): Operation(
        "cancelTask", "cancel a task", {"202": StateOut}, (*BODY_ERRORS, "404", "409", "503"), params=[TASK_ID]),
    ("post", "/v1/tasks/{id}/retry"): Operation(
        "retryTask", "retry a finished task", {"202": RetryOut}, (*BODY_ERRORS, "404", "409", "429", "503"),
        params=[TASK_ID]),
    ("post", "/v1/scans"): Operation(
        "submitScan", "start a scan of a profile (200: its idempotency_key found it submitted already)",
        {"201": ScanOut, "200": ScanOut}, SUBMIT_ERRORS, body=SubmitScan,
        links={"id": ("getScan", "cancelScan")}),
    ("get", "/v1/scans"): Operation(
        "listScans", "list scans with their jobs, newest first", {"200": ScanPageOut}, ("400", "503"),
        params=SCAN_LISTING),
    ("get", "/v1/scans/{id}"): Operation(
        "getScan", "a scan with its jobs and scope", {"200": ScanOut}, ("404", "503"), params=[SCAN_ID]),
    ("post", "/v1/scans/{id}/cancel"): Operation(
        "cancelScan", "cancel a scan: its running step's task, and the steps after it skipped", {"202": ScanStateOut},
        (*BODY_ERRORS, "404", "409", "503"), params=[SCAN_ID]),
    ("post", "/v1/scans/{id}/jobs/{index}/retry"): Operation(
        "retryScanJob", "run an ended scan again from a failed, timed-out or cancelled job", {"202": ScanOut},
        (*BODY_ERRORS, "404", "409", "429", "503"), params=[SCAN_ID, JOB_INDEX]),
    ("get", "/v1/pool"): Operation("getPool", "pool and queue figures", {"200": PoolOut}, ("503",)),
    ("patch", "/v1/pool"): Operation(
        "resizePool", "change pool sizes live", {"200": PoolOut}, (*BODY_ERRORS, "409", "503"), body=PoolPatch),
    ("get", "/v1/nodes"): Operation(
        "listNodes", "nodes sharing the store, with liveness", {"200": NodesOut}, ("503",)),
    ("get", "/v1/schedules"): Operation(
        "listSchedules", "schedules with next/last run", {"200": SchedulesOut}, ("503",)),
    ("post", "/v1/schedules"): Operation(
        "saveSchedule", "create or update a schedule", {"201": ScheduleOut}, (*BODY_ERRORS, "503"), body=ScheduleIn,
        links={"name": ("pauseSchedule", "resumeSchedule", "deleteSchedule")}),
    ("delete", "/v1/schedules/{name}"): Operation(
        "deleteSchedule", "delete a schedule", {"204": None}, ("404", "503"), params=[NAME]),
    ("post", "/v1/schedules/{name}/pause"): _schedule_action("pauseSchedule", "pause a schedule"),
    ("post", "/v1/schedules/{name}/resume"): _schedule_action("resumeSchedule", "resume a schedule at its next tick"),
    ("get", "/v1/events"): Operation(
        "streamEvents", "server-sent events; Last-Event-ID resumes", {"200": EventOut}, ("400", "404", "503"),
        params=EVENTS, media="text/event-stream"),
    ("get", "/v1/workers"): Operation("listWorkers", "the remote workers of the registry", {"200": WorkersOut},
                                      ("503",)),
    ("get", "/v1/workers/{id}"): Operation("getWorker", "one remote worker", {"200": WorkerOut}, ("404", "503"),
                                           params=[WORKER_ID]),
    ("patch", "/v1/workers/{id}"): Operation(
        "changeWorker", "enable, disable or limit a remote worker (409 once revoked)", {"200": WorkerOut},
        (*BODY_ERRORS, "404", "409", "503"), body=WorkerPatch, params=[WORKER_ID]),
    ("post", "/v1/workers/{id}/revoke"): Operation(
        "revokeWorker", "revoke a remote worker for good: its attempts cancelled, its connections closed",
        {"202": WorkerOut}, (*BODY_ERRORS, "404", "503"), params=[WORKER_ID]),
    ("get", "/healthz"): Operation("healthz", "the process answers", {"200": HealthOut}, open=True),
    ("get", "/readyz"): Operation("readyz", "ready to work", {"200": HealthOut, "503": HealthOut}, open=True),
}
W1_BODY_ERRORS = ("400", "403", "408", "413", "415", "503")
W1_OPERATIONS: dict[tuple[str, str], Operation] = {
    ("post", "/w1/acquire"): Operation(
        "acquire", "lease tasks, held up to min(wait_s, gateway.max_wait_s) until one exists",
        {"200": w1.AcquireOut}, W1_BODY_ERRORS, body=w1.AcquireIn, tag=W1_TAG),
    ("post", "/w1/renew"): Operation(
        "renew", "extend leases; each is held, to cancel, or lost", {"200": w1.RenewOut},
        (*W1_BODY_ERRORS, "410"), body=w1.RenewIn, tag=W1_TAG),
    ("post", "/w1/phase"): Operation(
        "notePhases", "record phases and progress", {"200": w1.PhaseOut}, (*W1_BODY_ERRORS, "410"),
        body=w1.PhaseIn, tag=W1_TAG),
    ("post", "/w1/results"): Operation(
        "recordResult", "store a result batch once (200: its key was stored already; 409: with another sha256)",
        {"201": w1.ResultAckOut, "200": w1.ResultAckOut}, (*W1_BODY_ERRORS, "409", "410"), body=w1.ResultIn,
        tag=W1_TAG),
    ("post", "/w1/finish"): Operation(
        "finish", "end attempts", {"200": w1.FinishOut}, (*W1_BODY_ERRORS, "410"), body=w1.FinishIn, tag=W1_TAG),
    ("get", "/w1/control"): Operation(
        "controlStream", "server-sent events for this worker: cancel, worker, wake", {"200": w1.ControlOut},
        ("403",), media="text/event-stream", tag=W1_TAG),
}
# Each model with the mode it is documented in: what a request may hold, or what an answer holds.
ANSWERS: set[type[BaseModel]] = {ErrorOut, *(m for ops in (OPERATIONS, W1_OPERATIONS) for op in ops.values()
                                              for m in op.ok.values() if m), w1.LeaseGoneOut}
REQUESTS: tuple[type[BaseModel], ...] = (SubmitTask, SubmitBatch, PoolPatch, ScheduleIn, SubmitScan, WorkerPatch,
                                         *w1.REQUESTS)
MODELS: list[tuple[type[BaseModel], JsonSchemaMode]] = [
    *((m, "validation") for m in REQUESTS),
    *((m, "serialization") for m in sorted(ANSWERS, key=lambda m: m.__name__)),
]


def document(routes: Collection[tuple[str, str]], *, task_types: Sequence[str] = (), profiles: Sequence[str] = (),
             bearer: bool = False, worker_protocol: bool = False) -> dict[str, Any]:
    """The document of `routes` (method and path, as the router holds them); `task_types` (the node's known
    types) become the enum of a task's type, and `profiles` (its scan profiles) that of a scan's; `bearer`: the
    node has a token, which every route but the probes needs; `worker_protocol`: the node is a gateway, whose
    /w1 routes (on their own listener) are described too. A route no operation describes is an error, so that
    a new route cannot go undocumented."""
    _undocumented(routes)
    _, defs = models_json_schema(MODELS, ref_template="#/components/schemas/{model}")
    schemas = defs["$defs"]
    if task_types:
        schemas["SubmitTask"]["properties"]["type"]["enum"] = list(task_types)
        schemas["ScheduleIn"]["properties"]["type"]["enum"] = [*task_types, None]  # null: a profile schedule
    if profiles:
        schemas["SubmitScan"]["properties"]["profile"]["enum"] = list(profiles)
        schemas["ScheduleIn"]["properties"]["profile"]["enum"] = [*profiles, None]
    paths: dict[str, dict[str, Any]] = {}
    for (method, path), op in OPERATIONS.items():
        if (method, op.route or path) in routes or ("*", op.route or path) in routes:
            paths.setdefault(path, {})[method] = _operation(op, bearer=bearer)
    for (method, path), op in W1_OPERATIONS.items() if worker_protocol else ():
        item = paths.setdefault(path, {"servers": W1_SERVERS})
        item[method] = {**_operation(op, bearer=False), "tags": [W1_TAG], "security": [{"mutualTLS": []}]}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "tidepool", "version": __version__,
                 "description": "The HTTP API of a tidepool node: tasks, scans, pool, schedules, nodes, events."},
        "paths": paths, "components": {"schemas": schemas}}
    schemes = {**({"mutualTLS": {"type": "mutualTLS"}} if worker_protocol else {}),
               **({"bearer": {"type": "http", "scheme": "bearer"}} if bearer else {})}
    if schemes:
        doc["components"]["securitySchemes"] = schemes
    if bearer:
        doc["security"] = [{"bearer": []}]
    return doc


def _undocumented(routes: Collection[tuple[str, str]]) -> None:
    described = {(method, op.route or path) for (method, path), op in OPERATIONS.items()}
    for method, path in routes:
        if method in ("head", "options") or path in UNDOCUMENTED:
            continue
        if (method, path) not in described and not (method == "*" and any(p == path for _, p in described)):
            raise ValueError(f"route {method.upper()} {path} has no operation in the OpenAPI document")


def _operation(op: Operation, *, bearer: bool) -> dict[str, Any]:
    responses = {status: _answer(op.summary, model, op.media) for status, model in op.ok.items()}
    for answer in responses.values():
        if op.links:
            answer["links"] = {target: {"operationId": target, "parameters": {name: f"$response.body#/{name}"}}
                               for name, targets in op.links.items() for target in targets}
    for status in (*op.errors, "403", *(("401",) if bearer and not op.open else ())):
        shape = w1.LeaseGoneOut if status == "410" else ErrorOut  # a lost lease's error says why
        responses[status] = _answer((W1_ERRORS if op.tag else ERRORS).get(status) or ERRORS[status], shape)
    out: dict[str, Any] = {"operationId": op.id, "summary": op.summary, "responses": responses}
    if op.body is not None:
        out["requestBody"] = {"required": True, **_content(op.body)}
    if op.params:
        out["parameters"] = list(op.params)
    if bearer and op.open:
        out["security"] = []
    return out


def _answer(description: str, model: type[BaseModel] | None, media: str = "application/json") -> dict[str, Any]:
    return {"description": description, **({} if model is None else _content(model, media))}


def _content(model: type[BaseModel], media: str = "application/json") -> dict[str, Any]:
    return {"content": {media: {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
