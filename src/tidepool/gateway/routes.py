"""The /w1 routes: each call's worker is the identity of its verified client certificate, its body a model
that refuses unknown fields, its errors JSON as the /v1 API's (a lost lease's with its `reason`)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from aiohttp import web
from pydantic import ValidationError

from ..client import API_HEADER
from ..errors import InvalidRequest, LeaseGone, WorkerRefused
from ..http.answers import ArtifactOut
from ..http.bodies import parse, streamed
from ..http.downloads import byte_range, send_blob
from ..http.guard import ConnectionGuard
from ..http.refusals import Refusal, error, errors_as_json
from ..model import SHA256_PATTERN, RemoteWorker, WorkerState, file_name_error
from . import files
from .control import ControlStream, frame, too_many_connections
from .protocol import Gateway
from .schemas import AcquireIn, FinishIn, LeaseIn, PhaseIn, RenewIn, ResultIn
from .tls import peer_of
from .trust import CHECK_EVERY_S, Trust

log = logging.getLogger("tidepool.gateway")
GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway")
GUARD: web.AppKey[ConnectionGuard] = web.AppKey("gateway_guard")
TRUST: web.AppKey[Trust] = web.AppKey("gateway_trust")
# A comment on an idle control stream, under common proxy idle timeouts; as often, the stream's certificate
# is looked at again.
KEEP_ALIVE_S = CHECK_EVERY_S
# A disabled worker keeps its connection (it renews and finishes what it runs): it only gets no control stream.
KEEPS_ITS_CONNECTION = frozenset({"worker_disabled"})


def _refusals(request: web.Request, exc: Exception) -> web.StreamResponse | None:
    """The gateway's own: a lost lease's 410 says why; a caller the gateway does not serve (no identity, pending,
    revoked, outdated, a conflicting or untrusted certificate, past its connections) keeps no connection: it is
    closed right after the answer."""
    if isinstance(exc, LeaseGone):
        answer = error(410, exc.code, str(exc), reason=exc.reason)
        if exc.reason == "revoked":
            answer.force_close()
        return answer
    if isinstance(exc, WorkerRefused):
        answer = error(403, exc.code, str(exc))
        if exc.code not in KEEPS_ITS_CONNECTION:
            answer.force_close()
            request.app[GATEWAY].controls.refused(exc.identity, exc.code)
        return answer
    if isinstance(exc, Refusal) and exc.code in ("no_identity", "too_many_connections"):
        answer = error(exc.status, exc.code, str(exc))
        answer.force_close()
        return answer
    return None


async def _caller(request: web.Request) -> RemoteWorker:
    """The calling worker's record, from its certificate (the TLS handshake has verified it, and the trust
    checks it still holds); a connection past its identity's cap is refused."""
    peer = peer_of(request.transport)
    if peer is None:
        raise Refusal(403, "no_identity", "the client certificate names no identity of 1-255 characters "
                                          "(a common name, else a DNS name)")
    gateway = request.app[GATEWAY]
    most = gateway.settings.max_connections_per_worker
    transport = request.transport
    if not gateway.controls.join(peer.identity, transport, most=most, when_lost=request.app[GUARD].when_lost):
        if transport is not None and not transport.is_closing():  # else answered and counted at its handshake
            gateway.metrics.connections_refused.inc(("too_many_connections",))
        raise Refusal(429, "too_many_connections", too_many_connections(peer.identity, most))
    refusal = request.app[TRUST].refusal(peer, request.transport)
    if refusal is not None:
        gateway.metrics.connections_refused.inc((refusal.code,))
        raise refusal
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


async def blob(request: web.Request) -> web.StreamResponse:
    """A blob's bytes (one range of them with a Range header), for a worker whose live lease names it."""
    gateway = request.app[GATEWAY]
    worker = await _caller(request)
    found = await files.leased_blob(gateway, worker, request.match_info["sha256"])
    return await send_blob(request, lambda start, stop: gateway.store.read_blob(found.sha256, start=start, stop=stop),
                           sha256=found.sha256, size=found.size, span=_range(request.headers.get("Range"), found.size),
                           content_type="application/octet-stream", reader=f"worker {worker.id}")


def _range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, stop) of a Range header's one range (bytes=a-b, a-, -n); None for the whole blob. A worker is
    told of a range it cannot have rather than sent what it did not ask for."""
    span = byte_range(header, size) if header is not None else None
    if header is not None and span is None:
        raise Refusal(416, "range_not_satisfiable", "Range: one range of bytes=START-END, START- or -LENGTH")
    if span is False:
        raise Refusal(416, "range_not_satisfiable", f"the blob holds {size} bytes")
    return None if span == (0, size) else span


async def artifact(request: web.Request) -> web.Response:
    """Record the body as the attempt's artifact `name`: fenced (name, identity, lease, quota) before a byte of
    the body is read, stored whole and its digest checked before it is recorded."""
    gateway = request.app[GATEWAY]
    worker = await _caller(request)
    attempt_id, name = request.match_info["attempt_id"], request.match_info["name"]
    if (why := file_name_error(name)) is not None:
        raise InvalidRequest("name", why)
    try:
        named = LeaseIn(attempt_id=attempt_id, lease_token=request.headers.get("X-Lease-Token", ""))
    except ValidationError:
        raise InvalidRequest("X-Lease-Token", "required: the lease token of the attempt the path names") from None
    if not re.match(SHA256_PATTERN, expect := request.headers.get("X-Content-SHA256", "")):
        raise InvalidRequest("X-Content-SHA256", "required: the lowercase hex SHA-256 of the body")
    lease = await files.held(gateway, worker, named)
    recorded = await files.check_quota(gateway, lease, name, request.content_length)
    content_type = request.headers.get("Content-Type")
    done = await files.record(gateway, worker, lease, name, streamed(request), expect=expect,
                              content_type=content_type[:200] if content_type else None)
    return web.json_response(ArtifactOut.model_validate(done).to_json(), status=200 if recorded else 201)


async def control(request: web.Request) -> web.StreamResponse:
    """The worker's control stream: its state first, then cancel, worker and wake events as they happen, until
    the worker drops it, a newer one of its own replaces it, or the gateway ends it (revoked, its certificate
    no longer trusted, shutdown). A disabled worker opens none."""
    gateway = request.app[GATEWAY]
    worker = await _caller(request)
    gateway.registry.refuse_unless_served(worker, write=False)
    if worker.state is WorkerState.DISABLED:
        raise WorkerRefused(worker.id, "worker_disabled", "disabled by an operator (a drain): no control stream "
                            "until it is enabled again; its acquires say when")
    stream, replaced = gateway.controls.open(worker.id, most=gateway.settings.max_control_streams)
    if replaced:
        gateway.metrics.connections_refused.inc(("control_streams",))
    transport = request.transport
    undo = request.app[GUARD].when_lost(transport, lambda: stream.close("dropped by the worker")) \
        if transport is not None else (lambda: None)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    opened = time.monotonic()
    try:
        await response.prepare(request)
        await response.write(frame("worker", {"state": worker.state.value}))
        if not await _follow(request, stream, response):
            response.force_close()  # its certificate is no longer trusted: nor is the connection
    except ConnectionError:  # the worker went away mid-write: a routine end, not a server error
        stream.close("dropped by the worker")
    finally:
        undo()
        gateway.controls.close(stream)
        if not stream.closed:
            stream.close("shutdown")  # cancelled
    if stream.why != "shutdown":  # a stopping gateway ends them all: no line for each
        log.info("worker %s control stream closed after %.1f s: %s", worker.id, time.monotonic() - opened,
                 stream.why)
    return response


async def _follow(request: web.Request, stream: ControlStream, response: web.StreamResponse) -> bool:
    """Write the stream's frames as they come, a keep-alive comment when there are none, until the stream is
    closed; what a revoke said before it closed the stream is written last. Every KEEP_ALIVE_S at least, the
    connection's certificate is checked again: False when it is no longer trusted."""
    trust, peer = request.app[TRUST], peer_of(request.transport)
    checked = time.monotonic()
    while not stream.closed:
        frames = await stream.next_frames(KEEP_ALIVE_S)
        if peer is not None and time.monotonic() - checked >= KEEP_ALIVE_S:
            checked = time.monotonic()
            if (refusal := trust.refusal(peer, request.transport)) is not None:
                request.app[GATEWAY].metrics.connections_refused.inc((refusal.code,))
                stream.close(refusal.code.replace("_", " "))
                return False
        await response.write(b"".join(frames) if frames else b": keep-alive\n\n")
    for last in await stream.next_frames(0):
        await response.write(last)
    return True


async def _identify(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[API_HEADER[0]] = "w1"


def build_app(gateway: Gateway, guard: ConnectionGuard, trust: Trust, *, max_body_kb: int) -> web.Application:
    refusals = errors_as_json(max_body_kb=lambda request: request.app[GATEWAY].max_body_kb, own=_refusals)
    app = web.Application(middlewares=[guard.next_request, refusals], client_max_size=max_body_kb * 1024)
    app.on_response_prepare.append(_identify)
    app[GATEWAY] = gateway
    app[GUARD] = guard
    app[TRUST] = trust
    app.router.add_post("/w1/acquire", acquire)
    app.router.add_post("/w1/renew", renew)
    app.router.add_post("/w1/phase", phase)
    app.router.add_post("/w1/results", results)
    app.router.add_post("/w1/finish", finish)
    app.router.add_get("/w1/control", control, allow_head=False)
    app.router.add_get("/w1/blobs/{sha256}", blob, allow_head=False)
    app.router.add_put("/w1/artifacts/{attempt_id}/{name}", artifact)
    return app
