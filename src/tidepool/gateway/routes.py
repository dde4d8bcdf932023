"""The /w1 routes: each call's worker is the identity of its verified client certificate, its body a model
that refuses unknown fields, its errors JSON as the /v1 API's (a lost lease's with its `reason`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler

from ..api.app import ApiError, parse
from ..client import API_HEADER
from ..errors import LeaseGone, TidepoolError, WorkerRefused
from ..http.guard import ConnectionGuard
from ..model import RemoteWorker
from .control import frame
from .protocol import Gateway
from .schemas import AcquireIn, FinishIn, PhaseIn, RenewIn, ResultIn
from .tls import peer_of

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway")
GUARD: web.AppKey[ConnectionGuard] = web.AppKey("gateway_guard")
KEEP_ALIVE_S = 15.0  # a comment on an idle control stream, under common proxy idle timeouts


def _error(status: int, code: str, message: str, **more: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message, **more}}, status=status)


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return _error(exc.status, exc.code, str(exc))
    except LeaseGone as exc:
        answer = _error(410, exc.code, str(exc), reason=exc.reason)
        if exc.reason == "revoked":
            answer.force_close()
        return answer
    except WorkerRefused as exc:
        answer = _error(403, exc.code, str(exc))
        if exc.code in ("worker_revoked", "worker_pending"):
            answer.force_close()  # a worker that is not served keeps no connection open
        return answer
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {413: "body_too_large", 404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        message = f"request body is over {request.app[GATEWAY].max_body_kb} KiB" if exc.status == 413 else exc.reason
        return _error(exc.status, code, message)
    except TidepoolError as exc:
        if exc.http_status is None:
            raise
        return _error(exc.http_status, exc.code, str(exc))


async def _caller(request: web.Request) -> RemoteWorker:
    """The calling worker's record, from its certificate (the TLS handshake has verified it)."""
    peer = peer_of(request.transport)
    if peer is None:
        raise ApiError(403, "no_identity", "the client certificate names no identity of 1-255 characters "
                                           "(a common name, else a DNS name)")
    gateway = request.app[GATEWAY]
    gateway.controls.seen(peer.identity, request.transport, request.app[GUARD].when_lost)
    return await gateway.meet(peer)


def _version(request: web.Request) -> str | None:
    """The tidepool version a worker reports: its Tidepool-Version header, else a User-Agent of tidepool/X."""
    version = request.headers.get("Tidepool-Version")
    if version is None and (agent := request.headers.get("User-Agent", "")).startswith("tidepool/"):
        version = agent.removeprefix("tidepool/").split()[0]
    return version[:100] if version else None


async def acquire(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    worker = await _caller(request)
    gateway.registry.refuse_unless_served(worker, write=False)
    body = await parse(request, AcquireIn)
    transport = request.transport

    def gone() -> bool:
        return transport is None or transport.is_closing()

    def on_gone(callback: Callable[[], None]) -> Callable[[], None]:
        if transport is None:
            callback()
            return lambda: None
        return request.app[GUARD].when_lost(transport, callback)

    answer = await gateway.acquire(worker, body, version=_version(request), gone=gone, on_gone=on_gone)
    return web.json_response(answer)


async def renew(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    worker = await _caller(request)
    body = await parse(request, RenewIn)
    return web.json_response(await gateway.renew(worker, body.leases))


async def phase(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    worker = await _caller(request)
    body = await parse(request, PhaseIn)
    return web.json_response(await gateway.phase(worker, body.notes))


async def results(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    worker = await _caller(request)
    body = await parse(request, ResultIn)
    ack, new = await gateway.result(worker, body)
    return web.json_response({"attempt_id": ack.attempt_id, "plugin": ack.plugin, "sequence": ack.sequence,
                              "idempotency_key": ack.idempotency_key, "sha256": ack.sha256, "final": ack.final},
                             status=201 if new else 200)


async def finish(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    worker = await _caller(request)
    body = await parse(request, FinishIn)
    return web.json_response(await gateway.finish(worker, body.endings))


async def control(request: web.Request) -> web.StreamResponse:
    """The worker's control stream: its state first, then cancel, worker and wake events as they happen."""
    gateway = request.app[GATEWAY]
    worker = await _caller(request)
    gateway.registry.refuse_unless_served(worker, write=False)
    stream = gateway.controls.open(worker.id)
    undo = request.app[GUARD].when_lost(request.transport, stream.close) if request.transport else (lambda: None)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
        await response.write(frame("worker", {"state": worker.state.value}))
        while not stream.closed:
            frames = await stream.next_frames(KEEP_ALIVE_S)
            await response.write(b"".join(frames) if frames else b": keep-alive\n\n")
        for last in await stream.next_frames(0):  # what a revoke said before it closed the stream
            await response.write(last)
    except (ConnectionError, asyncio.CancelledError):
        if not stream.closed:
            stream.close()
        raise
    finally:
        undo()
        gateway.controls.close(stream)
    return response


async def _identify(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[API_HEADER[0]] = "w1"


def build_app(gateway: Gateway, guard: ConnectionGuard, *, max_body_kb: int) -> web.Application:
    app = web.Application(middlewares=[guard.next_request, errors_as_json], client_max_size=max_body_kb * 1024)
    app.on_response_prepare.append(_identify)
    app[GATEWAY] = gateway
    app[GUARD] = guard
    app.router.add_post("/w1/acquire", acquire)
    app.router.add_post("/w1/renew", renew)
    app.router.add_post("/w1/phase", phase)
    app.router.add_post("/w1/results", results)
    app.router.add_post("/w1/finish", finish)
    app.router.add_get("/w1/control", control, allow_head=False)
    return app
