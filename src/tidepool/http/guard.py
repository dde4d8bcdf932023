"""The connection guard: the hygiene aiohttp lacks, a deadline for request headers and a cap on open connections.

aiohttp has no deadline for receiving a request's headers, so a client trickling bytes holds its
connection forever (a slowloris attack). Each connection is wrapped: if a request has not reached
the app within `header_timeout_s` of its first byte (of the connection, for the first request), or
the server already holds `max_connections`, the connection is closed. The app's `next_request`
middleware says when a request arrives and when it is done; the next byte after that starts the
next request's clock. Idle keep-alive connections are closed by aiohttp's keepalive_timeout; bodies
have their own deadline where they are read (bodies.parse).

`TIDEPOOL_API_HEADER_TIMEOUT_S` (read once, at import) overrides the header deadline. It is a private
knob for tests that prove the cut-off in seconds rather than minutes, not a configuration key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler

from ..client import API_HEADER
from ..logs import Outage
from ..settings import api_address

log = logging.getLogger("tidepool.api")
HEADER_TIMEOUT_S = float(os.environ.get("TIDEPOOL_API_HEADER_TIMEOUT_S") or 10.0)
MAX_CONNECTIONS = 512
# asyncio listens with a backlog of 100: 200 clients connecting at once had SYNs dropped and waited
# for the kernel's 1 s retransmit (measured: POST max 1.1 s against a p99 of 62 ms). Room for every
# connection the cap admits, and more, to be accepted and then refused with an answer.
LISTEN_BACKLOG = 2 * MAX_CONNECTIONS
KEEPALIVE_TIMEOUT_S = 15.0


class ConnectionGuard:
    """`name` is the server's, as its log lines say it ("API", "gateway listener"), in `logger`."""

    def __init__(self, *, header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 name: str = "API", logger: logging.Logger = log) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.name = name
        self.open = 0
        self.full = Outage(logger)  # said once when the cap starts refusing, once when it admits again
        self._connections: dict[object, _Guarded] = {}  # by transport, for the middleware

    def wrap(self, factory: Callable[[], RequestHandler]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Guarded(_answering_as_tidepool(factory()), self)

    def admitted(self, handler: RequestHandler) -> _Guarded:
        """The guarded protocol of a connection `admit` already counted (a listener that admits before its
        TLS handshake); its loss releases the place."""
        return _Guarded(_answering_as_tidepool(handler), self, counted=True)

    def admit(self) -> bool:
        """Whether one more connection may be held; if so it is counted, until `release` (or its loss)."""
        if self.open >= self.max_connections:
            self.full.failing("%s: %d connections are open, the most it holds; new ones are closed at once",
                              self.name, self.max_connections)
            return False
        self.open += 1
        self.full.over("%s: a new connection was admitted again (%d open)", self.name, self.open)
        return True

    def release(self) -> None:
        """An admitted connection that never reached its protocol (its TLS handshake failed)."""
        self.open -= 1

    def hurry(self, transport: asyncio.BaseTransport, deadline_s: float) -> None:
        """The connection's first request must come within `deadline_s`: one of a caller that may hold no
        connection is not kept for the full header deadline."""
        connection = self._connections.get(transport)
        if connection is not None:
            connection.hurry(deadline_s)

    def when_lost(self, transport: asyncio.BaseTransport, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` once the connection of `transport` is gone (at once if it is already); the answer
        takes it back (a kept-alive connection serves more requests than this one)."""
        connection = self._connections.get(transport)
        if connection is None:
            callback()
            return lambda: None
        connection.on_lost.append(callback)
        return lambda: connection.on_lost.remove(callback) if callback in connection.on_lost else None

    @web.middleware
    async def next_request(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A request's headers are complete once aiohttp hands it to us: its header deadline ends here.
        After it, the connection's next bytes start the next one."""
        connection = self._connections.get(request.transport)
        if connection is not None:
            connection.request_started()
        try:
            return await handler(request)
        finally:
            if connection is not None:
                connection.expect_request()


class _AnswersAsTidepool(RequestHandler):
    """aiohttp answers a request it cannot parse (a header line too long, a malformed one) itself, before
    any middleware: that answer is ours too, in JSON with the API header, so a client can tell a refusal
    by the daemon from something else answering at its address."""

    __slots__ = ()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs it, as aiohttp does
        code = "invalid_request" if status < 500 else "internal_error"
        answer = web.json_response({"error": {"code": code, "message": message or plain.reason}}, status=status,
                                   headers=dict([API_HEADER]))
        answer.force_close()
        return answer


def _answering_as_tidepool(handler: RequestHandler) -> RequestHandler:
    handler.__class__ = _AnswersAsTidepool  # same layout (no slots of its own): only handle_error differs
    return handler


class _Guarded(asyncio.Protocol):
    """Forwards everything to aiohttp's protocol; cuts the connection when a request's headers take too long.

    The deadline ends when the app sees the request (the middleware says so), not when the bytes look
    like the end of a header block: a body left unread could hold a blank line and switch it off.
    """

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard, *, counted: bool = False) -> None:
        self._inner = inner
        self._guard = guard
        self._counted = counted  # its place among max_connections is taken
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._between_requests = False  # the last request is done; the next one has not begun
        self.on_lost: list[Callable[[], None]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports don't subclass asyncio's
        self._guard._connections[transport] = self
        self._inner.connection_made(transport)
        if not self._counted:
            if not self._guard.admit():
                self._cut_off()
                return
            self._counted = True
        self._start_clock()

    def request_started(self) -> None:
        self._between_requests = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def expect_request(self) -> None:
        self._between_requests = True

    def hurry(self, deadline_s: float) -> None:
        if self._timer is not None and not self._between_requests:
            self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(deadline_s, self._cut_off)

    def data_received(self, data: bytes) -> None:
        if self._between_requests:
            self._between_requests = False
            self._start_clock()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._counted:
            self._guard.open -= 1
        self._guard._connections.pop(self._transport, None)
        self._inner.connection_lost(exc)
        for callback in self.on_lost:
            callback()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def _start_clock(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._guard.header_timeout_s, self._cut_off)

    def _cut_off(self) -> None:
        if self._transport is not None:
            self._transport.abort()


class GuardedSite(web.BaseSite):
    """A TCP or unix-socket site whose connections pass through a ConnectionGuard."""

    __slots__ = ("_guard", "_listen", "_socket_file")

    def __init__(self, runner: web.BaseRunner, listen: str, guard: ConnectionGuard) -> None:
        super().__init__(runner)
        self._listen = listen  # checked by the settings: a port the kernel would choose is refused there
        self._guard = guard
        self._socket_file: tuple[str, int, int] | None = None  # a unix socket's path, device and inode

    @property
    def name(self) -> str:
        return self._listen

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        assert self._runner.server is not None
        factory: Any = self._guard.wrap(self._runner.server)
        address = api_address(self._listen)
        try:
            if isinstance(address, str):
                self._server = await loop.create_unix_server(factory, address, backlog=LISTEN_BACKLOG)
                made = os.stat(address)
                self._socket_file = (address, made.st_dev, made.st_ino)
            else:
                self._server = await loop.create_server(factory, *address, reuse_address=True,
                                                        backlog=LISTEN_BACKLOG)
        except OSError as exc:  # a unix socket's error names no path: "No such file or directory"
            raise OSError(f"api.listen {self._listen}: {exc.strerror or exc}") from exc

    async def stop(self) -> None:
        """Closing a unix socket leaves its file: it goes too, unless something has bound the path since."""
        await super().stop()
        if self._socket_file is not None:
            path, device, inode = self._socket_file
            with contextlib.suppress(FileNotFoundError):
                now = os.stat(path)
                if (now.st_dev, now.st_ino) == (device, inode):
                    os.unlink(path)
