"""tcp_connect and http_probe held to a scope: real servers on two loopback addresses (127.0.0.1, the scope's,
and 127.0.0.2, outside it), the probes run by the engine from the config's keys, and nothing ever reaching
the server outside. Names are resolved through socket.getaddrinfo, which the tests answer for `.test` names."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tidepool.errors import TargetRefused
from tidepool.model import State
from tidepool.plugins import Registry
from tidepool.plugins.netprobe import http_probe, tcp_connect
from tidepool.plugins.scope import Scope
from tidepool.settings import PluginSpec, PluginsSettings, TypeSettings
from tidepool.store.sqlite import SqliteStore

from .conftest import GRACE_S, running_node

pytestmark = pytest.mark.timeout(60)

INSIDE, OUTSIDE = "127.0.0.1", "127.0.0.2"
TYPES = {"tcp_connect": TypeSettings(plugins=("tcp_connect",)), "http_probe": TypeSettings(plugins=("http_probe",))}


class Server:
    """A web server on one address that counts the requests it got; `redirect_to` makes GET / answer 302."""

    def __init__(self) -> None:
        self.requests = 0
        self.redirect_to: str | None = None
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        if self.redirect_to is not None:
            raise web.HTTPFound(self.redirect_to)
        return web.Response(text="hello")


@contextlib.asynccontextmanager
async def server_on(address: str, port: int = 0) -> AsyncIterator[Server]:
    server = Server()
    app = web.Application()
    app.router.add_get("/", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, address, port)
        await site.start()
        server.port = int(runner.addresses[0][1])
        yield server
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def counting_listener(address: str) -> AsyncIterator[tuple[int, list[int]]]:
    """A TCP listener on `address`; yields its port and the list its accepted connections are counted in."""
    accepted: list[int] = []

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.close()

    listener = await asyncio.start_server(on_connect, address, 0)
    try:
        yield int(listener.sockets[0].getsockname()[1]), accepted
    finally:
        listener.close()
        await listener.wait_closed()


def answering(monkeypatch: pytest.MonkeyPatch, answers: Callable[[str], list[str] | None]) -> None:
    """socket.getaddrinfo answers `.test` names with answers(name); any other name as the host does."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.endswith(".test"):
            found = answers(host)
            if found is None:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, int(port or 0))) for a in found]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def registry(*, execution_scope: tuple[str, ...] = (), **defs: PluginSpec) -> Registry:
    return Registry.from_settings(PluginsSettings(defs=defs), TYPES, kill_grace_s=GRACE_S, scope=execution_scope)


async def test_tcp_connect_refuses_a_port_outside_its_scope_without_connecting(
        sqlite_store: SqliteStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answering(monkeypatch, lambda name: [INSIDE])
    scoped = registry(tcp_connect=PluginSpec(scope=(f"{OUTSIDE}/32",)))
    async with counting_listener(INSIDE) as (port, accepted), \
            running_node(sqlite_store, {}, registry=scoped, work_root=tmp_path) as node:
        by_address = await node.finished(await node.submit("tcp_connect", {"target": INSIDE, "ports": [port]}))
        by_name = await node.finished(await node.submit("tcp_connect", {"target": "moved.test", "ports": [port]}))
        inside = await tcp_connect(INSIDE, [port], scope=Scope.of(["127.0.0.0/30"]))

    for task in (by_address, by_name):
        assert task.state is State.FAILED and task.error is not None
        assert task.error.code == "out_of_scope" and len(task.attempts) == 1  # not retried
    assert by_address.error is not None and by_name.error is not None
    assert by_address.error.message == f"payload.target: {INSIDE} is outside the scope ({OUTSIDE}/32)"
    assert by_name.error.message == (f"payload.target: 'moved.test' resolves to {INSIDE}, outside the scope "
                                     f"({OUTSIDE}/32)")
    assert inside["open"] == [port]
    assert len(accepted) == 1  # the in-scope scan's connect only: the refused ones never connected


async def test_execution_scope_holds_a_builtin_prober_that_names_none(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    async with server_on(INSIDE) as server, running_node(
            sqlite_store, {}, registry=registry(execution_scope=(f"{OUTSIDE}/32",)), work_root=tmp_path) as node:
        task = await node.finished(await node.submit("http_probe", {"url": f"http://{INSIDE}:{server.port}/"}))
    assert task.state is State.FAILED and task.error is not None and task.error.code == "out_of_scope"
    assert server.requests == 0


async def test_http_probe_does_not_follow_a_redirect_out_of_its_scope(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    scoped = registry(http_probe=PluginSpec(scope=(f"{INSIDE}/32",)))
    async with server_on(INSIDE) as start, server_on(OUTSIDE) as elsewhere, \
            running_node(sqlite_store, {}, registry=scoped, work_root=tmp_path) as node:
        start.redirect_to = f"http://{OUTSIDE}:{elsewhere.port}/"
        task = await node.finished(await node.submit("http_probe", {"url": f"http://{INSIDE}:{start.port}/"}))
        followed = await http_probe(f"http://{INSIDE}:{start.port}/", scope=Scope.of(["127.0.0.0/30"]))

    assert task.state is State.FAILED and task.error is not None
    assert (task.error.code, len(task.attempts)) == ("out_of_scope", 1)
    assert task.error.message == (
        f"payload.url: http://{INSIDE}:{start.port}/ redirects to http://{OUTSIDE}:{elsewhere.port}/, which is "
        f"not followed: {OUTSIDE} is outside the scope ({INSIDE}/32)")
    assert followed["final_url"] == f"http://{OUTSIDE}:{elsewhere.port}/"  # a wider scope follows it
    assert (start.requests, elsewhere.requests) == (2, 1)  # the outside server saw the wider scope's request only


async def test_a_redirect_to_a_name_that_resolves_outside_is_not_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    answering(monkeypatch, lambda name: [OUTSIDE])
    async with server_on(INSIDE) as start, server_on(OUTSIDE) as elsewhere:
        start.redirect_to = f"http://elsewhere.test:{elsewhere.port}/"
        with pytest.raises(TargetRefused, match=rf"redirects to http://elsewhere\.test:{elsewhere.port}/, which is "
                                                rf"not followed: 'elsewhere\.test' resolves to {OUTSIDE}, outside"):
            await http_probe(f"http://{INSIDE}:{start.port}/", scope=Scope.of([f"{INSIDE}/32"]))
    assert elsewhere.requests == 0


async def test_a_name_that_rebinds_after_its_check_is_never_connected_outside(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The name answers inside first and outside after: whichever resolution the connection uses, it is one
    that was checked, so the probe is refused rather than sent to the server outside (on the same port)."""
    asked: list[str] = []

    def rebinding(name: str) -> list[str]:
        asked.append(name)
        return [INSIDE] if len(asked) == 1 else [OUTSIDE]

    answering(monkeypatch, rebinding)
    async with server_on(INSIDE) as inside, server_on(OUTSIDE, inside.port) as outside:
        with pytest.raises(TargetRefused, match=rf"'rebind\.test' resolves to {OUTSIDE}, outside the scope"):
            await http_probe(f"http://rebind.test:{inside.port}/", scope=Scope.of([f"{INSIDE}/32"]))
    assert len(asked) >= 2 and outside.requests == 0


async def test_a_target_outside_fails_the_web_probe_of_its_ports_before_any_connect() -> None:
    from tidepool.plugins.netprobe import probe_web_ports

    async with server_on(INSIDE) as server:
        with pytest.raises(TargetRefused, match=rf"^payload\.target: {INSIDE} is outside"):
            await probe_web_ports(INSIDE, [server.port], scope=Scope.of([f"{OUTSIDE}/32"]))
        summary, _answers = await probe_web_ports(INSIDE, [server.port], scope=Scope.of([f"{INSIDE}/32"]))
    assert summary["web"] == [server.port] and server.requests == 1


CALLED: list[str] = []


async def noted(ctx: Any) -> None:
    """A Python plugin held to a scope by its config: it notes each target it was let run with."""
    CALLED.append(ctx.payload["host"])


async def test_a_python_plugin_with_scope_fields_starts_only_inside(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    CALLED.clear()
    spec = PluginSpec(python=f"{__name__}:noted", scope=(f"{INSIDE}/32",), scope_fields=("host",))
    scoped = Registry.from_settings(PluginsSettings(defs={"noted": spec}), {"noted": TypeSettings(plugins=("noted",))},
                                    kill_grace_s=GRACE_S)
    async with running_node(sqlite_store, {}, registry=scoped, work_root=tmp_path) as node:
        inside = await node.finished(await node.submit("noted", {"host": INSIDE}))
        outside = await node.finished(await node.submit("noted", {"host": [INSIDE, OUTSIDE]}))
    assert inside.state is State.COMPLETED
    assert outside.state is State.FAILED and outside.error is not None
    assert outside.error.message == f"payload.host.1: {OUTSIDE} is outside the scope ({INSIDE}/32)"
    assert CALLED == [INSIDE]
