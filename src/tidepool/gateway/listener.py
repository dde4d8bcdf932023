"""The gateway's TLS listener: the /w1 app on a socket of its own, behind the same connection guard as the
/v1 API (a deadline for each request's headers, a cap on connections, a short keep-alive), with a deadline
for the TLS handshake as well."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import anyio
from aiohttp import web
from anyio.abc import TaskStatus

from ..http.guard import HEADER_TIMEOUT_S, KEEPALIVE_TIMEOUT_S, LISTEN_BACKLOG, ConnectionGuard
from ..settings import api_address
from .protocol import Gateway
from .routes import build_app
from .tls import Credentials

# Each held acquire holds its connection for up to gateway.max_wait_s: a fleet of remote workers needs more
# connections at once than the /v1 API's cap, and each still costs little (a parked coroutine, no thread).
MAX_CONNECTIONS = 4096


class TlsSite(web.BaseSite):
    """A TCP site whose connections complete a mutual TLS handshake, then pass through a ConnectionGuard."""

    __slots__ = ("_context", "_guard", "_listen")

    def __init__(self, runner: web.BaseRunner, listen: str, guard: ConnectionGuard, context: ssl.SSLContext) -> None:
        super().__init__(runner)
        self._listen, self._guard, self._context = listen, guard, context

    @property
    def name(self) -> str:
        return f"https://{self._listen}"

    async def start(self) -> None:
        await super().start()
        assert self._runner.server is not None
        factory: Any = self._guard.wrap(self._runner.server)
        address = api_address(self._listen)
        assert not isinstance(address, str), "the settings refuse a unix socket for the gateway"
        host, port = address
        try:
            self._server = await asyncio.get_running_loop().create_server(
                factory, host, port, ssl=self._context, reuse_address=True, backlog=LISTEN_BACKLOG,
                ssl_handshake_timeout=self._guard.header_timeout_s)
        except OSError as exc:
            raise OSError(f"gateway.listen {self._listen}: {exc.strerror or exc}") from exc


async def serve_gateway(gateway: Gateway, credentials: Credentials, listen: str, *,
                        header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Bind gateway.listen and serve the worker protocol until cancelled; control streams end first."""
    guard = ConnectionGuard(header_timeout_s=header_timeout_s, max_connections=max_connections)
    app = build_app(gateway, guard, max_body_kb=gateway.max_body_kb)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
    await runner.setup()
    try:
        await TlsSite(runner, listen, guard, credentials.listening).start()
        task_status.started()
        await anyio.sleep_forever()
    finally:
        gateway.controls.close_all()
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
