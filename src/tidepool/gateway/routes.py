"""The /w1 routes: each call's worker is the identity of its verified client certificate, its body a model
that refuses unknown fields, its errors JSON as the /v1 API's (a lost lease's with its `reason`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from ..client import API_HEADER
from ..errors import LeaseGone, WorkerRefused
from ..http.bodies import parse
from ..http.guard import ConnectionGuard
from ..http.refusals import Refusal, error, errors_as_json
from ..model import RemoteWorker
from .control import frame
from .protocol import Gateway
from .schemas import AcquireIn, FinishIn, PhaseIn, RenewIn, ResultIn
from .tls import peer_of

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway")
GUARD: web.AppKey[ConnectionGuard] = web.AppKey("gateway_guard")
KEEP_ALIVE_S = 15.0  # a comment on an idle control stream, under common proxy idle timeouts


def _refusals(request: web.Request, exc: Exception) -> web.StreamResponse | None:
    """The gateway's own: a lost lease's 410 says why; a worker the registry does not serve keeps no connection."""
    if isinstance(exc, LeaseGone):
        answer = error(410, exc.code, str(exc), reason=exc.reason)
        if exc.reason == "revoked":
            answer.force_close()
        return answer
    if isinstance(exc, WorkerRefused):
        answer = error(403, exc.code, str(exc))
        if exc.code in ("worker_revoked", "worker_pending", "worker_outdated"):
            answer.force_close()  # a worker that is not served keeps no connection open
        return answer
    return None


async def _caller(request: web.Request) -> RemoteWorker:
    """The calling worker's record, from its certificate (the TLS handshake has verified it)."""
    peer = peer_of(request.transport)
    if peer is None:
        raise Refusal(403, "no_identity", "the client certificate names no identity of 1-255 characters "
                                          "(a common name, else a DNS name)")
    gateway = request.app[GATEWAY]
    gateway.controls.seen(peer.identity, request.transport, request.app[GUARD].when_lost)
    return await gateway.meet(peer, version=_version(request))


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
    refusals = errors_as_json(max_body_kb=lambda request: request.app[GATEWAY].max_body_kb, own=_refusals)
    app = web.Application(middlewares=[guard.next_request, refusals], client_max_size=max_body_kb * 1024)
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
