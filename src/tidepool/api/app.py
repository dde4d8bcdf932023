"""Routes of the HTTP API: JSON in and out, every error as {"error": {"code", "message"}}."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TypeVar

import anyio
from aiohttp import web
from aiohttp.typedefs import Handler
from anyio.abc import TaskStatus
from pydantic import BaseModel, ValidationError

from ..client import API_HEADER
from ..errors import InvalidRequest, TaskNotFound, TidepoolError
from ..http.bodies import body_error
from ..http.guard import KEEPALIVE_TIMEOUT_S, ConnectionGuard, GuardedSite
from ..metrics.exporter import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..model import ORGANIZATION_PATTERN, State
from ..settings import api_address
from . import openapi, scans, stream, workers
from .auth import TOKEN, require_token
from .browsers import browser_guard, no_framing
from .operations import Operations
from .schemas import MAX_LIST_LIMIT, NoFields, PoolPatch, ScheduleIn, SubmitBatch, SubmitTask, TaskDetailOut, TaskOut

M = TypeVar("M", bound=BaseModel)
DAEMON: web.AppKey[Operations] = web.AppKey("daemon")  # the node the API serves, as its operations
FANOUT: web.AppKey[stream.Fanout] = web.AppKey("fanout")
STREAMS: web.AppKey[stream.StreamLimit] = web.AppKey("streams")
GUARD: web.AppKey[ConnectionGuard] = web.AppKey("guard")
BODY_TIMEOUT_S = 30.0
STATIC = Path(__file__).parent / "static"
CURSOR = re.compile(r"[0-9a-f]{32}")  # a next_cursor is a task id (model.new_id)


def error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error(exc.status, exc.code, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {413: "body_too_large", 404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        message = exc.reason
        if exc.status == 413:
            message = f"request body is over {request.app[DAEMON].max_body_kb} KiB"
        elif exc.status == 404 and not request.path.startswith("/static/"):  # a route, not a dashboard file:
            # say which was asked (a client's base URL may hold a path too many)
            message = f"no route {request.method} {request.path[:200]}; see /v1/openapi.json for the API's routes"
        response = error(exc.status, code, message)
        if "Allow" in exc.headers:  # a 405 must say which methods the route has (RFC 9110)
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except TidepoolError as exc:
        if exc.http_status is None:  # not an answer: a server error
            raise
        return error(exc.http_status, exc.code, str(exc))


@web.middleware
async def no_nul(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A NUL character (%00) is part of no id, name or filter; PostgreSQL cannot even compare text with
    one, so it would come back as a 503 that clients retry for ever."""
    if "\x00" in request.path:
        raise InvalidRequest("path", "a NUL character is part of no id or name")
    for key, value in request.query.items():
        if "\x00" in key or "\x00" in value:
            raise InvalidRequest(key.replace("\x00", ""), "a NUL character is part of no filter")
    return await handler(request)


async def parse(request: web.Request, model: type[M]) -> M:
    """The request body validated against `model`; 415 when not JSON, 400 naming the bad field."""
    _json_only(request)
    return _validated(await _body(request), model)


def _json_only(request: web.Request) -> None:
    if request.content_type != "application/json":
        raise _http(415, "unsupported_media_type", "send the body as application/json")


async def _body(request: web.Request) -> bytes:
    try:
        with anyio.fail_after(BODY_TIMEOUT_S):  # a client trickling its body is cut off
            return await request.read()
    except TimeoutError:
        raise _http(408, "request_timeout", f"the body did not arrive within {BODY_TIMEOUT_S}s") from None


def _validated(raw: bytes, model: type[M]) -> M:
    try:
        json.loads(raw or b"null", parse_constant=_no_constant, parse_float=_finite)
    except ValueError as exc:
        raise _http(400, "invalid_json", f"body is not valid JSON: {exc}") from None
    except RecursionError:  # the decoder recurses per level: deep nesting must not reach the 500 handler
        raise _http(400, "invalid_json", "body is not valid JSON: nested too deeply") from None
    try:
        # Strict: JSON true is not the integer 1 and "5" is not 5; RFC 3339 strings still make datetimes.
        return model.model_validate_json(raw or b"null", strict=True)
    except ValidationError as exc:
        raise _http(400, *body_error(exc)) from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    """1e400 is JSON, but as a float it is infinity, which no JSON answer could carry back."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is beyond a 64-bit float")
    return value


class ApiError(Exception):
    """A request the API refuses, with its status and error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _http(status: int, code: str, message: str) -> ApiError:
    return ApiError(status, code, message)


async def submit(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    body = await parse(request, SubmitTask)
    task, created = await daemon.submit(body.to_new(default_max_attempts=daemon.max_attempts_for(body.type)))
    return web.json_response(TaskDetailOut.of(task).to_json(), status=201 if created else 200)


async def submit_batch(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    body = await parse(request, SubmitBatch)
    news = [t.to_new(default_max_attempts=daemon.max_attempts_for(t.type)) for t in body.tasks]
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


LIST_PARAMETERS = ("state", "type", "limit", "cursor", "organization")


async def list_tasks(request: web.Request) -> web.Response:
    q = _one_each(request, LIST_PARAMETERS)
    state = None
    if "state" in q:  # present but empty is not "no filter": the document lists the states
        try:
            state = State(q["state"])
        except ValueError:
            raise _http(400, "invalid_request", f"state: unknown state {q['state']!r}") from None
    if q.get("type") == "":
        raise _http(400, "invalid_request", "type: empty; leave the parameter out to list every type")
    limit = q.get("limit", "50")
    if not (limit.isascii() and limit.isdigit()):  # int() would take "1_0", " 10" and "+10"
        raise _http(400, "invalid_request", "limit: expected an integer")
    if not 1 <= int(limit) <= MAX_LIST_LIMIT:
        raise _http(400, "invalid_request", f"limit: must be between 1 and {MAX_LIST_LIMIT}")
    cursor = q.get("cursor") or None
    if cursor is not None and not CURSOR.fullmatch(cursor):
        raise _http(400, "invalid_request", "cursor: pass back a next_cursor of an earlier page")
    organization = q.get("organization")
    if organization is not None and not re.fullmatch(ORGANIZATION_PATTERN, organization):
        raise _http(400, "invalid_request", f"organization: {organization!r} is not an organization name: 1 to 64 "
                                            "of the characters A-Z a-z 0-9 . _ -")
    page = await request.app[DAEMON].list_tasks(state=state, type=q.get("type"), limit=int(limit), cursor=cursor,
                                                organization=organization)
    return web.json_response({"tasks": [TaskOut.of(t).to_json() for t in page.tasks],
                              "next_cursor": page.next_cursor})


def _one_each(request: web.Request, known: tuple[str, ...]) -> dict[str, str]:
    """The query's parameters, each at most once and each one the route knows: a misspelt filter must not
    answer with everything, nor a repeated one with whichever came first."""
    q = request.query
    for name in q:
        if name not in known:
            raise _http(400, "invalid_request", f"{name}: not a parameter of this route (it takes {', '.join(known)})")
        if len(q.getall(name)) > 1:
            raise _http(400, "invalid_request", f"{name}: given {len(q.getall(name))} times; give it once")
    return dict(q)


async def no_body(request: web.Request) -> None:
    """A route that takes no body refuses one with fields (or one that is not JSON) rather than ignore what
    the caller meant it to change; an empty body (chunked too) and {} are fine."""
    if request.can_read_body and (raw := await _body(request)):
        _json_only(request)
        _validated(raw, NoFields)


async def cancel(request: web.Request) -> web.Response:
    await no_body(request)
    state = await request.app[DAEMON].cancel(request.match_info["id"])
    return web.json_response({"state": state.value}, status=202)


async def retry(request: web.Request) -> web.Response:
    await no_body(request)
    task = await request.app[DAEMON].retry(request.match_info["id"])
    return web.json_response({"state": task.state.value, "task": TaskOut.of(task).to_json()}, status=202)


async def get_pool(request: web.Request) -> web.Response:
    return web.json_response(await request.app[DAEMON].pool_view())


async def patch_pool(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    body = await parse(request, PoolPatch)
    try:
        daemon.resize(**body.model_dump(exclude_none=True))
    except ValueError as exc:
        raise _http(400, "invalid_request", str(exc)) from None
    return web.json_response(await daemon.pool_view())


async def list_nodes(request: web.Request) -> web.Response:
    return web.json_response({"nodes": await request.app[DAEMON].nodes_view()})


async def list_schedules(request: web.Request) -> web.Response:
    return web.json_response({"schedules": await request.app[DAEMON].schedules_view()})


async def create_schedule(request: web.Request) -> web.Response:
    body = await parse(request, ScheduleIn)
    daemon = request.app[DAEMON]
    saved = await daemon.save_schedule(body.to_schedule())
    return web.json_response(await daemon.schedule_view(saved), status=201)


async def delete_schedule(request: web.Request) -> web.Response:
    await request.app[DAEMON].delete_schedule(request.match_info["name"])
    return web.Response(status=204)


async def pause_schedule(request: web.Request) -> web.Response:
    daemon, paused = request.app[DAEMON], request.match_info["action"] == "pause"
    saved = await daemon.pause_schedule(request.match_info["name"], paused=paused)
    return web.json_response(await daemon.schedule_view(saved))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    reason = await request.app[DAEMON].not_ready_reason()
    if reason:
        return web.json_response({"status": "unavailable", "reason": reason}, status=503)
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    body = await request.app[DAEMON].render_metrics()
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def events(request: web.Request) -> web.StreamResponse:
    streams = request.app[STREAMS]
    if not streams.admit():
        raise _http(503, "too_many_streams", f"{streams.limit} event streams are open, the most this node serves: "
                                             "try again later, or poll GET /v1/tasks/{id}")
    try:
        guard = request.app.get(GUARD)
        return await stream.events(request, request.app[DAEMON], request.app[FANOUT],
                                   None if guard is None else guard.when_lost)
    finally:
        streams.release()


async def openapi_json(request: web.Request) -> web.Response:
    routes = {(route.method.lower(), route.resource.canonical) for route in request.app.router.routes()
              if route.resource is not None}
    return web.json_response(openapi.document(routes, task_types=sorted(request.app[DAEMON].registry.types),
                                              profiles=sorted(request.app[DAEMON].scans.profiles),
                                              bearer=request.app[TOKEN] is not None,
                                              worker_protocol=request.app[DAEMON].serves_workers))


async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def _identify(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[API_HEADER[0]] = API_HEADER[1]


def build_app(daemon: Operations, fanout: stream.Fanout, *, token: str | None = None,
              guard_browsers: bool = False) -> web.Application:
    """`guard_browsers`: refuse what web pages may not do to an API without a token (see browsers)."""
    middlewares = [errors_as_json, *([browser_guard()] if guard_browsers else []), require_token, no_nul]
    app = web.Application(middlewares=middlewares, client_max_size=daemon.max_body_kb * 1024)
    app.on_response_prepare.append(no_framing)
    app.on_response_prepare.append(_identify)
    app[DAEMON] = daemon
    app[FANOUT] = fanout
    app[TOKEN] = token
    app[STREAMS] = stream.StreamLimit()
    app.router.add_post("/v1/tasks", submit)
    app.router.add_route("*", "/v1/tasks/batch", batch_only)  # every method, or GET falls through to {id}
    app.router.add_get("/v1/tasks", list_tasks)
    app.router.add_get("/v1/tasks/{id}", get_task)
    app.router.add_post("/v1/tasks/{id}/cancel", cancel)
    app.router.add_post("/v1/tasks/{id}/retry", retry)
    app.router.add_get("/v1/pool", get_pool)
    app.router.add_patch("/v1/pool", patch_pool)
    app.router.add_get("/v1/nodes", list_nodes)
    scans.add_routes(app.router)
    workers.add_routes(app)
    app.router.add_get("/v1/schedules", list_schedules)
    app.router.add_post("/v1/schedules", create_schedule)
    app.router.add_delete("/v1/schedules/{name}", delete_schedule)
    app.router.add_post(r"/v1/schedules/{name}/{action:pause|resume}", pause_schedule)
    app.router.add_get("/v1/events", events, allow_head=False)  # a HEAD must not start a stream
    app.router.add_get("/v1/openapi.json", openapi_json)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", dashboard)
    app.router.add_static("/static", STATIC)
    return app


async def serve_api(daemon: Operations, listen: str, *, token: str | None = None,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Bind `listen` ("host:port" or "unix:/path"), serve until cancelled."""
    guard = ConnectionGuard()
    fanout = stream.Fanout(daemon.events)
    app = build_app(daemon, fanout, token=token,
                    guard_browsers=token is None and not isinstance(api_address(listen), str))
    app.middlewares.insert(0, guard.next_request)
    app[GUARD] = guard
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
    await runner.setup()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(fanout.run)
            site = GuardedSite(runner, listen, guard)
            await site.start()
            task_status.started()
            await anyio.sleep_forever()
    finally:
        fanout.close()  # every stream ends with its final event now, not when cleanup gives up on it
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
