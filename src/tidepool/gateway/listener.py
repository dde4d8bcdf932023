"""The gateway's TLS listener: the /w1 app on sockets of its own, behind the same connection guard as the /v1
API (a deadline for each request's headers, a cap on connections, a short keep-alive), with two more steps
for each connection it accepts: the cap is applied before any byte of TLS (a full listener closes the new
socket at once, a refusal costs no handshake, and so does one past its source address's handshakes in flight),
and the handshake has a short deadline of its own."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import socket
import ssl
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import anyio
from aiohttp import web
from anyio.abc import TaskGroup, TaskStatus

from ..client import API_HEADER
from ..http.guard import HEADER_TIMEOUT_S, KEEPALIVE_TIMEOUT_S, LISTEN_BACKLOG, MAX_CONNECTIONS, ConnectionGuard
from ..logs import Outage
from ..settings import api_address
from .control import too_many_connections
from .protocol import Gateway
from .routes import build_app
from .tls import Credentials, peer_of
from .trust import Trust

log = logging.getLogger("tidepool.gateway")
NAME = "gateway listener"
# The open files a node needs besides the listener's connections: the /v1 API's own connections (its cap),
# four per pool worker (a command's three pipes and its pidfd) and a margin for the store's connections and
# files, the log and journal, and what plugins open in the daemon's process.
FILES_PER_POOL_WORKER = 4
FILES_MARGIN = 256
MIN_CONNECTIONS = 64
# A new connection of an identity lately refused (revoked, pending, outdated) sends its first request at once
# or is closed: it is not held for the whole header deadline.
REFUSED_FIRST_REQUEST_S = 1.0
# A closed connection waits this long for its peer's close_notify: one that never answers it (a refused
# caller) keeps its place no longer (asyncio's default is 30 s).
SHUTDOWN_TIMEOUT_S = 2.0
# A TLS 1.3 handshake with a client certificate is two round trips: done in a second even over a slow link.
# A socket that has not finished it by then holds a place in the listener for nothing (one that never sends a
# ClientHello would hold it until the header deadline).
HANDSHAKE_TIMEOUT_S = 3.0
# Connections of one source address in their handshake at once: above what a worker opens at once (each of
# its 64 held acquires is a connection of its own) or a NAT of a few of them, reconnecting after a gateway
# restart; past it a new one is closed at once, so one address cannot fill the listener with silent sockets
# before any certificate has been seen.
MAX_HANDSHAKES_PER_ADDRESS = 128
ACCEPT_RETRY_S = 1.0  # out of file descriptors: accepting again this much later (asyncio's servers do the same)
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def connection_cap(max_connections: int, *, pool_workers: int) -> int:
    """gateway.max_connections, or when it is 0, what the process's open-file limit leaves for the listener:
    the soft RLIMIT_NOFILE minus MAX_CONNECTIONS (the /v1 API) minus FILES_PER_POOL_WORKER x pool.max_workers
    minus FILES_MARGIN, and never under MIN_CONNECTIONS. The systemd unit raises the limit (LimitNOFILE)."""
    if max_connections:
        return max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    reserve = MAX_CONNECTIONS + FILES_PER_POOL_WORKER * pool_workers + FILES_MARGIN
    return max(MIN_CONNECTIONS, soft - reserve)


class TlsListener:
    """The sockets of gateway.listen, and each connection they accept: counted against the cap (or closed at
    once), then its mutual TLS handshake within the header deadline, then the guard and the app."""

    def __init__(self, listen: str, guard: ConnectionGuard, context: ssl.SSLContext,
                 handler: Callable[[], Any], *, refused: Callable[[str], None],
                 admitted: Callable[[asyncio.BaseTransport], None]) -> None:
        self._listen, self._guard, self._context, self._handler = listen, guard, context, handler
        self._refused = refused    # a connection refused, by reason (the metric)
        self._admitted = admitted  # a connection past its handshake, its peer known
        self._no_files = Outage(log)
        self._handshaking: Counter[str] = Counter()  # connections in their handshake, by source address

    def bind(self) -> list[socket.socket]:
        """The listening sockets (one per address the host resolves to); OSError naming gateway.listen."""
        address = api_address(self._listen)
        assert not isinstance(address, str), "the settings refuse a unix socket for the gateway"
        host, port = address
        sockets: list[socket.socket] = []
        try:
            found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            for family, kind, proto, _, where in dict.fromkeys(found):  # once each, in the resolver's order
                sock = socket.socket(family, kind, proto)
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(where)
                sock.listen(LISTEN_BACKLOG)
                sock.setblocking(False)
        except OSError as exc:
            for sock in sockets:
                sock.close()
            raise OSError(f"gateway.listen {self._listen}: {exc.strerror or exc}") from exc
        return sockets

    async def accept(self, sock: socket.socket, tg: TaskGroup) -> None:
        """Accept connections until cancelled: past a cap each is closed before its handshake."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, source = await loop.sock_accept(sock)
            except (ConnectionAbortedError, InterruptedError):
                continue  # the client left before it was accepted
            except OSError as exc:
                if exc.errno not in _OUT_OF_FILES:
                    raise
                self._no_files.failing("%s: cannot accept connections: %s; trying again every %.0f s", NAME,
                                       exc.strerror or exc, ACCEPT_RETRY_S)
                await anyio.sleep(ACCEPT_RETRY_S)
                continue
            self._no_files.over("%s: accepting connections again", NAME)
            address = str(source[0])
            if self._closed_at_once(connection, address):
                continue
            self._handshaking[address] += 1
            tg.start_soon(self._handshake, connection, address)

    def _closed_at_once(self, connection: socket.socket, address: str) -> bool:
        """Whether a new connection is closed before its handshake: its source address has
        MAX_HANDSHAKES_PER_ADDRESS handshakes in flight, or the listener holds its cap (else it is counted)."""
        if self._handshaking[address] >= MAX_HANDSHAKES_PER_ADDRESS:
            reason = "handshakes_per_address"
        elif not self._guard.admit():
            reason = "listener_full"
        else:
            return False
        connection.close()
        self._refused(reason)
        return True

    async def _handshake(self, connection: socket.socket, address: str) -> None:
        """The TLS handshake of an admitted connection, within HANDSHAKE_TIMEOUT_S (never past the header
        deadline); its place is given back if it fails."""
        made = False
        try:
            transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
                lambda: self._guard.admitted(self._handler()), connection, ssl=self._context,
                ssl_handshake_timeout=min(HANDSHAKE_TIMEOUT_S, self._guard.header_timeout_s),
                ssl_shutdown_timeout=SHUTDOWN_TIMEOUT_S)
            made = True
        except OSError as exc:  # ssl.SSLError, a reset, the handshake's deadline: nothing was served
            log.debug("%s: a TLS handshake failed: %s", NAME, exc)
            return
        except Exception:  # one connection's fault never stops the listener
            log.exception("%s: a connection could not be set up", NAME)
            return
        finally:
            self._handshaking[address] -= 1
            if not self._handshaking[address]:
                del self._handshaking[address]  # kept for the addresses handshaking now, not every one seen
            if not made:
                self._guard.release()
                connection.close()
        if not transport.is_closing():
            self._admitted(transport)


def _holding_nothing(gateway: Gateway, guard: ConnectionGuard) -> Callable[[asyncio.BaseTransport], None]:
    """What a connection is told once its handshake names its peer. One past its identity's own cap is answered
    429 and closed at once; it keeps its place in the listener until its socket is closed (its peer's answer to
    the close, or SHUTDOWN_TIMEOUT_S): a place stands for an open socket, and places given back before their
    sockets were gone would let refused sockets pile up past the cap and the open files it is sized for. One of
    an identity refused lately (revoked, pending, outdated) must send its first request at once: a revoked
    worker may still say that what the revoke cancelled has stopped, and a pending one may have been enabled
    since, but neither holds a silent connection."""

    def admitted(transport: asyncio.BaseTransport) -> None:
        peer = peer_of(transport)
        if peer is None:
            return  # its first request is refused: no identity
        controls, most = gateway.controls, gateway.settings.max_connections_per_worker
        if not controls.join(peer.identity, transport, most=most, when_lost=guard.when_lost):
            gateway.metrics.connections_refused.inc(("too_many_connections",))
            _answer_and_close(transport, 429, "too_many_connections", too_many_connections(peer.identity, most))
        elif controls.refusal_of(peer.identity) is not None:
            guard.hurry(transport, REFUSED_FIRST_REQUEST_S)

    return admitted


def _answer_and_close(transport: asyncio.BaseTransport, status: int, code: str, message: str) -> None:
    """An answer before any request, as a server may send one (as to a request that takes too long), then the
    close: the caller reads it whether it has sent its request yet or not."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{API_HEADER[0]}: w1\r\n\r\n")
    transport.write(head.encode() + body)  # type: ignore[attr-defined]
    transport.close()


async def serve_gateway(gateway: Gateway, credentials: Credentials, listen: str, *,
                        header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int | None = None,
                        pool_workers: int = 0, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Bind gateway.listen and serve the worker protocol until cancelled; control streams end first.
    `max_connections` overrides gateway.max_connections (sized as connection_cap says, for a node of
    `pool_workers` pool workers)."""
    cap = max_connections or connection_cap(gateway.settings.max_connections, pool_workers=pool_workers)
    guard = ConnectionGuard(header_timeout_s=header_timeout_s, max_connections=cap, name=NAME,
                            logger=log)
    app = build_app(gateway, guard, Trust(credentials), max_body_kb=gateway.max_body_kb)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
    await runner.setup()
    assert runner.server is not None
    refused = gateway.metrics.connections_refused
    tls = TlsListener(listen, guard, credentials.listening, runner.server,
                      refused=lambda reason: refused.inc((reason,)), admitted=_holding_nothing(gateway, guard))
    sockets = tls.bind()
    log.debug("%s on %s: at most %d connections", NAME, listen, cap)
    try:
        async with anyio.create_task_group() as tg:
            for sock in sockets:
                tg.start_soon(tls.accept, sock, tg)
            task_status.started()
    finally:
        for sock in sockets:
            sock.close()
        gateway.controls.close_all()
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
