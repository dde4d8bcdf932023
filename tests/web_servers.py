"""Real web servers on loopback for the probes: plain HTTP or TLS (a certificate of the lab CA), on free ports."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from tidepool.gateway import pki

LOOPBACK = "127.0.0.1"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _hello(request: web.Request) -> web.Response:
    return web.Response(text="hello", headers={"Server": f"probe-{request.scheme}"})


def tls_context(lab: pki.Lab) -> ssl.SSLContext:
    """A server context with the lab gateway's certificate (its SANs include localhost and 127.0.0.1)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(lab.gateway.cert, lab.gateway.key)
    return context


@contextlib.asynccontextmanager
async def serving(ssl_context: ssl.SSLContext | None = None, *, handler: Handler = _hello,
                  sites: int = 1) -> AsyncIterator[list[int]]:
    """`handler` on GET / on `sites` free loopback ports (TLS with `ssl_context`); yields the ports."""
    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        for _ in range(sites):
            await web.TCPSite(runner, LOOPBACK, 0, ssl_context=ssl_context).start()
        yield [int(address[1]) for address in runner.addresses]
    finally:
        await runner.cleanup()

