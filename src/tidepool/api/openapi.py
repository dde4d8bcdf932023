"""The OpenAPI 3.1 document of the API: the node's routes, each described by the pydantic models that validate
its requests and shape its answers, and a bearer scheme only on a node that has a token. The routes of the
worker protocol are described too on a node that serves remote workers: the node hands their description in
(ServerPaths), so the API never imports the gateway."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from .. import __version__
from ..events import EVENT_NAMES
from ..http.answers import ErrorOut, TaskDetailOut
from ..http.openapi import Operation, ServerPaths
from ..model import FILE_NAME_PATTERN, ORGANIZATION_PATTERN, SHA256_PATTERN, State
from ..scans import ScanState
from .auth import TOKEN
from .blobs import ArtifactsOut, BlobOut
from .listing import CURSOR_PATTERN, MAX_LIST_LIMIT
from .node import HealthOut, NodesOut, PoolOut, PoolPatch
from .operations import DAEMON
from .scans import MAX_JOB_INDEX, ScanOut, ScanPageOut, ScanStateOut, SubmitScan
from .schedules import ScheduleIn, ScheduleOut, SchedulesOut
from .stream import EventOut
from .tasks import IdsOut, PageOut, RetryOut, StateOut, SubmitBatch, SubmitTask
from .workers import WorkerOut, WorkerPatch, WorkersOut

# The worker protocol's routes, as the node hands them in (None: an app built without them).
WORKER_PROTOCOL: web.AppKey[ServerPaths | None] = web.AppKey("worker_protocol")
ERRORS = {"400": "invalid input, naming the field", "401": "missing or wrong bearer token",
          "403": "a change asked from another origin, or (without a token) a Host that is not a loopback name",
          "404": "no such task, schedule or scan", "408": "the body did not arrive in time",
          "409": "conflicts with the task's or scan's state, an earlier submit or the node's (draining)",
          "413": "body over api.max_body_kb", "415": "body is not application/json",
          "416": "the Range lies past the end of the bytes",
          "429": "queue over pool.max_queued", "503": "store unavailable, or too many event streams"}
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
SHA256 = _param("sha256", "path", {"type": "string", "pattern": SHA256_PATTERN}, required=True,
                description="the blob's name: the lowercase hex SHA-256 of its bytes")
ARTIFACT = (TASK_ID, _param("name", "path", {"type": "string", "pattern": FILE_NAME_PATTERN}, required=True),
            _param("attempt", "query", {"type": "string", "minLength": 1},
                   description="the attempt whose artifact to send (default: the newest attempt's)"))
UPLOAD = (_param("X-Content-SHA256", "header", {"type": "string", "pattern": SHA256_PATTERN},
                 description="the body's sha256: if the bytes differ, 400 digest_mismatch and nothing stored"),)
BYTES = "application/octet-stream"
RANGED = "the bytes; one `Range: bytes=a-b` (or a-, -n) answers 206 with that range, past the end 416"
EVENT_ID = {"type": "string", "pattern": "^[0-9]{0,20}$"}
# What a stream's `type` filter may name: every event, each family's glob, and all of them. (The stream takes
# any glob that matches an event, and comma-separated lists; these are the forms the document promises.)
EVENT_FILTERS = sorted(EVENT_NAMES | {name.split(".")[0] + ".*" for name in EVENT_NAMES} | {"*"})
LISTING = (_param("state", "query", {"type": "string", "enum": [s.value for s in State]}),
           _param("type", "query", {"type": "string", "minLength": 1}),
           _param("limit", "query", {"type": "integer", "minimum": 1, "maximum": MAX_LIST_LIMIT}),
           _param("organization", "query", {"type": "string", "pattern": ORGANIZATION_PATTERN}),
           _param("cursor", "query", {"type": "string", "pattern": CURSOR_PATTERN},
                  description="the next_cursor of the page before"))
SCAN_ID = _param("id", "path", {"type": "string"}, required=True)
JOB_INDEX = _param("index", "path", {"type": "integer", "minimum": 0, "maximum": MAX_JOB_INDEX}, required=True)
SCAN_LISTING = (_param("state", "query", {"type": "string", "enum": [s.value for s in ScanState]}),
                _param("profile", "query", {"type": "string", "minLength": 1}),
                *(p for p in LISTING if p["name"] in ("limit", "cursor")))
EVENTS = (_param("task_id", "query", {"type": "string"}),
          _param("type", "query", {"type": "array", "items": {"type": "string", "enum": EVENT_FILTERS}},
                 style="form", explode=True, description="event names, a family's glob (task.*) or *, repeated"),
          _param("last_event_id", "query", EVENT_ID, description="as Last-Event-ID, for clients that cannot set it"),
          _param("Last-Event-ID", "header", EVENT_ID))


def _schedule_action(name: str, summary: str) -> Operation:
    return Operation(name, summary, {"200": ScheduleOut}, ("404", "503"), params=[NAME],
                     route="/v1/schedules/{name}/{action}")


SUBMIT_ERRORS = (*BODY_ERRORS, "409", "429", "503")
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("post", "/v1/tasks"): Operation(
        "submitTask", "submit a task (200: its idempotency_key found it submitted already)",
        {"201": TaskDetailOut, "200": TaskDetailOut}, SUBMIT_ERRORS, body=SubmitTask,
        links={"id": ("getTask", "cancelTask", "retryTask", "listArtifacts")}),
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
    ("get", "/v1/tasks/{id}/artifacts"): Operation(
        "listArtifacts", "the files its attempts recorded, oldest first", {"200": ArtifactsOut}, ("404", "503"),
        params=[TASK_ID]),
    ("get", "/v1/tasks/{id}/artifacts/{name}"): Operation(
        "getArtifact", f"an artifact's bytes, the newest attempt's unless one is named: {RANGED}",
        {"200": None, "206": None}, ("400", "404", "416", "503"), params=ARTIFACT, media=BYTES,
        said={"404": "no such task, or it has no artifact of that name (of that attempt)"}),
    ("post", "/v1/blobs"): Operation(
        "uploadBlob", "store bytes as a blob, named by their sha256 (200: it was stored already)",
        {"201": BlobOut, "200": BlobOut}, ("400", "408", "413", "415", "503"), params=UPLOAD, bytes_body=BYTES,
        links={"sha256": ("getBlob", "headBlob")},
        said={"413": "the blob is over artifacts.max_blob_bytes: nothing stored",
              "415": "body is not application/octet-stream"}),
    ("get", "/v1/blobs/{sha256}"): Operation(
        "getBlob", f"a blob's {RANGED}", {"200": None, "206": None}, ("400", "404", "416", "503"), params=[SHA256],
        media=BYTES, said={"404": "no blob of that sha256"}),
    ("head", "/v1/blobs/{sha256}"): Operation(
        "headBlob", "whether a blob is stored, and its size (Content-Length)", {"200": None},
        ("400", "404", "503"), params=[SHA256], said={"404": "no blob of that sha256"}),
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
# The models the document holds: what a request may hold, or what an answer holds.
ANSWERS: set[type[BaseModel]] = {ErrorOut, *(m for op in OPERATIONS.values() for m in op.ok.values() if m)}
REQUESTS: tuple[type[BaseModel], ...] = (SubmitTask, SubmitBatch, PoolPatch, ScheduleIn, SubmitScan, WorkerPatch)


async def document_json(request: web.Request) -> web.Response:
    """GET /v1/openapi.json: the document of the routes this app serves, for the node it serves."""
    routes = {(route.method.lower(), route.resource.canonical) for route in request.app.router.routes()
              if route.resource is not None}
    daemon = request.app[DAEMON]
    return web.json_response(document(routes, task_types=sorted(daemon.registry.types),
                                      profiles=sorted(daemon.scans.profiles), bearer=request.app[TOKEN] is not None,
                                      workers=request.app[WORKER_PROTOCOL], serves_workers=daemon.serves_workers))


def document(routes: Collection[tuple[str, str]], *, task_types: Sequence[str] = (), profiles: Sequence[str] = (),
             bearer: bool = False, workers: ServerPaths | None = None, serves_workers: bool = False) -> dict[str, Any]:
    """The document of `routes` (method and path, as the router holds them); `task_types` (the node's known
    types) become the enum of a task's type, and `profiles` (its scan profiles) that of a scan's; `bearer`: the
    node has a token, which every route but the probes needs; `workers`: the worker protocol's routes, whose
    bodies are among the schemas whenever given; `serves_workers`: the node is a gateway, whose /w1 routes (on
    their own listener) are described too. A route no operation describes is an error, so that a new route
    cannot go undocumented."""
    _undocumented(routes)
    _, defs = models_json_schema(_models(workers), ref_template="#/components/schemas/{model}")
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
    if workers is not None and serves_workers:
        _add_paths(paths, workers)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "tidepool", "version": __version__,
                 "description": "The HTTP API of a tidepool node: tasks, scans, pool, schedules, nodes, events."},
        "paths": paths, "components": {"schemas": schemas}}
    schemes = {**(workers.schemes if workers is not None and serves_workers else {}),
               **({"bearer": {"type": "http", "scheme": "bearer"}} if bearer else {})}
    if schemes:
        doc["components"]["securitySchemes"] = schemes
    if bearer:
        doc["security"] = [{"bearer": []}]
    return doc


def _models(workers: ServerPaths | None) -> list[tuple[type[BaseModel], JsonSchemaMode]]:
    """Each model with the mode it is documented in, the requests first and the answers by name."""
    requests = (*REQUESTS, *(workers.requests if workers is not None else ()))
    answers = ANSWERS | (workers.answers() if workers is not None else set())
    return [*((m, "validation") for m in requests),
            *((m, "serialization") for m in sorted(answers, key=lambda m: m.__name__))]


def _add_paths(paths: dict[str, dict[str, Any]], workers: ServerPaths) -> None:
    """The other server's routes: each path names its server, each operation its tag and security schemes."""
    for (method, path), op in workers.operations.items():
        item = paths.setdefault(path, {"servers": workers.servers})
        item[method] = {**_operation(op, bearer=False), "tags": [workers.tag],
                        "security": [{name: [] for name in workers.schemes}]}


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
        responses[status] = _answer(op.said.get(status) or ERRORS[status], op.error_bodies.get(status, ErrorOut))
    out: dict[str, Any] = {"operationId": op.id, "summary": op.summary, "responses": responses}
    if op.body is not None:
        out["requestBody"] = {"required": True, **_content(op.body)}
    if op.bytes_body is not None:
        out["requestBody"] = {"required": True, "content": {op.bytes_body: {"schema": BINARY}}}
    if op.params:
        out["parameters"] = list(op.params)
    if bearer and op.open:
        out["security"] = []
    return out


BINARY = {"type": "string", "format": "binary"}


def _answer(description: str, model: type[BaseModel] | None, media: str = "application/json") -> dict[str, Any]:
    if model is None and media != "application/json":  # raw bytes
        return {"description": description, "content": {media: {"schema": BINARY}}}
    return {"description": description, **({} if model is None else _content(model, media))}


def _content(model: type[BaseModel], media: str = "application/json") -> dict[str, Any]:
    return {"content": {media: {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
