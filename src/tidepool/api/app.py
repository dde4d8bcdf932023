"""The API's app: its middleware (errors as JSON, the browser guard, the token, no NUL in a path or query) and
its routes table, and serving it on TCP or a unix socket. Each route's handler is its resource's module."""

from __future__ import annotations

import anyio
from aiohttp import web
from aiohttp.typedefs import Handler
from anyio.abc import TaskStatus

from ..client import API_HEADER
from ..errors import InvalidRequest
from ..http.guard import KEEPALIVE_TIMEOUT_S, ConnectionGuard, GuardedSite
from ..http.openapi import ServerPaths
from ..http.refusals import error, errors_as_json, http_code
from ..settings import api_address
from . import blobs, node, openapi, scans, schedules, stream, tasks, workers
from .auth import TOKEN, holds_token, require_token
from .browsers import browser_guard, no_framing
from .operations import DAEMON, Operations


def _refusals(request: web.Request, exc: Exception) -> web.StreamResponse | None:
    """The API's own: a route not found says which was asked (a client's base URL may hold a path too many),
    and a 405 says which methods the route has (RFC 9110)."""
    if not isinstance(exc, web.HTTPException) or exc.status < 400:
        return None
    if exc.status == 404 and not request.path.startswith("/static/"):  # a route, not a dashboard file
        message = f"no route {request.method} {request.path[:200]}; see /v1/openapi.json for the API's routes"
        return error(exc.status, http_code(exc), message)
    if "Allow" in exc.headers:
        response = error(exc.status, http_code(exc), exc.reason)
        response.headers["Allow"] = exc.headers["Allow"]
        return response
    return None


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


async def _identify(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[API_HEADER[0]] = API_HEADER[1]


def build_app(daemon: Operations, fanout: stream.Fanout, *, token: str | None = None, guard_browsers: bool = False,
              worker_protocol: ServerPaths | None = None) -> web.Application:
    """`guard_browsers`: refuse what web pages may not do to an API without a token (see browsers);
    `worker_protocol`: the gateway's routes, for the document."""
    refusals = errors_as_json(max_body_kb=lambda request: request.app[DAEMON].max_body_kb, own=_refusals,
                              trusted=holds_token)
    middlewares = [refusals, *([browser_guard()] if guard_browsers else []), require_token, no_nul]
    app = web.Application(middlewares=middlewares, client_max_size=daemon.max_body_kb * 1024)
    app.on_response_prepare.append(no_framing)
    app.on_response_prepare.append(_identify)
    app[DAEMON] = daemon
    app[stream.FANOUT] = fanout
    app[TOKEN] = token
    app[stream.STREAMS] = stream.StreamLimit()
    app[openapi.WORKER_PROTOCOL] = worker_protocol
    app.router.add_post("/v1/tasks", tasks.submit)
    app.router.add_route("*", "/v1/tasks/batch", tasks.batch_only)  # every method, or GET falls through to {id}
    app.router.add_get("/v1/tasks", tasks.list_tasks)
    app.router.add_get("/v1/tasks/{id}", tasks.get_task)
    app.router.add_post("/v1/tasks/{id}/cancel", tasks.cancel)
    app.router.add_post("/v1/tasks/{id}/retry", tasks.retry)
    app.router.add_get("/v1/tasks/{id}/artifacts", blobs.list_artifacts)
    app.router.add_get("/v1/tasks/{id}/artifacts/{name}", blobs.get_artifact)
    app.router.add_post("/v1/blobs", blobs.upload)
    app.router.add_get("/v1/blobs/{sha256}", blobs.download)  # and HEAD
    app.router.add_get("/v1/pool", node.get_pool)
    app.router.add_patch("/v1/pool", node.patch_pool)
    app.router.add_get("/v1/nodes", node.list_nodes)
    app.router.add_post("/v1/scans", scans.submit)
    app.router.add_get("/v1/scans", scans.list_scans)
    app.router.add_get("/v1/scans/{id}", scans.get_scan)
    app.router.add_post("/v1/scans/{id}/cancel", scans.cancel)
    app.router.add_post("/v1/scans/{id}/jobs/{index}/retry", scans.retry_job)
    app.router.add_get("/v1/workers", workers.list_workers)
    app.router.add_get("/v1/workers/{id}", workers.get_worker)
    app.router.add_patch("/v1/workers/{id}", workers.patch_worker)
    app.router.add_post("/v1/workers/{id}/revoke", workers.revoke_worker)
    app.router.add_get("/v1/schedules", schedules.list_schedules)
    app.router.add_post("/v1/schedules", schedules.create_schedule)
    app.router.add_delete("/v1/schedules/{name}", schedules.delete_schedule)
    app.router.add_post(r"/v1/schedules/{name}/{action:pause|resume}", schedules.pause_schedule)
    app.router.add_get("/v1/events", stream.events, allow_head=False)  # a HEAD must not start a stream
    app.router.add_get("/v1/openapi.json", openapi.document_json)
    app.router.add_get("/healthz", node.healthz)
    app.router.add_get("/readyz", node.readyz)
    app.router.add_get("/metrics", node.metrics)
    app.router.add_get("/", node.dashboard)
    app.router.add_static("/static", node.STATIC)
    return app


async def serve_api(daemon: Operations, listen: str, *, token: str | None = None,
                    worker_protocol: ServerPaths | None = None,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Bind `listen` ("host:port" or "unix:/path"), serve until cancelled; `worker_protocol`: the gateway's
    routes, which the API's document describes on a node that serves remote workers."""
    guard = ConnectionGuard()
    fanout = stream.Fanout(daemon.events)
    app = build_app(daemon, fanout, token=token,
                    guard_browsers=token is None and not isinstance(api_address(listen), str),
                    worker_protocol=worker_protocol)
    app.middlewares.insert(0, guard.next_request)
    app[stream.GUARD] = guard
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
