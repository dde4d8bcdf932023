"""What one identity may hold of the gateway, over real TLS: its connections and control streams are capped so
that the others are still served; a caller the gateway does not serve keeps no connection; a connection whose
certificate a reload no longer trusts is closed, control streams included; a worker that drops its control
stream costs one INFO line."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import pytest

from tidepool.gateway import pki, routes
from tidepool.settings import load

from ..lab import make_lab
from .conftest import AUTO, MakeNode, Node, Remote, client_context, expiring_context, gateway_settings, open_control
from .test_listener import Opened, close, listener, tls
from .test_tls import write_config

AT_ONCE_S = 3.0  # far short of the 10 s a connection may wait for its first request's headers
PER_WORKER = 4


class Raw(NamedTuple):
    status: int | None  # None: closed unanswered
    code: str | None
    closed: bool  # the gateway closed the connection after it
    said_close: bool = False  # the answer said so (Connection: close)


async def call_on(opened: Opened, path: str = "/w1/acquire", body: Any = None) -> Raw:
    """POST `body` on a raw connection and read its answer, then whether the gateway closes the connection."""
    reader, writer = opened
    data = json.dumps({"types": ["noop"], "max": 1, "wait_s": 0} if body is None else body).encode()
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass  # closed already: its answer may still be there to read
    try:
        with anyio.fail_after(AT_ONCE_S):
            head = await reader.readuntil(b"\r\n\r\n")
            status, *headers = head.decode().split("\r\n")
            length = next(int(h.split(":")[1]) for h in headers if h.lower().startswith("content-length:"))
            answer = json.loads(await reader.readexactly(length))
    except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
        return Raw(None, None, True)
    code = answer["error"]["code"] if isinstance(answer, dict) and "error" in answer else None
    said_close = any(h.lower() == "connection: close" for h in headers)
    return Raw(int(status.split()[1]), code, await closed_soon(reader), said_close)


async def closed_soon(reader: asyncio.StreamReader) -> bool:
    """Whether the gateway closes the connection within AT_ONCE_S (what it sends meanwhile is read past)."""
    try:
        with anyio.move_on_after(AT_ONCE_S):
            while await reader.read(65536):
                pass
            return True
    except (ConnectionError, ssl.SSLError):
        return True
    return False


def refusals(node: Node, reason: str) -> float:
    return node.daemon.gateway.metrics.connections_refused.values[(reason,)]


async def test_a_flood_of_one_identitys_connections_leaves_the_others_served(make_node: MakeNode) -> None:
    listener_cap = 3 * PER_WORKER  # the flood is far more than the whole listener holds
    async with make_node(gateway={**AUTO, "max_connections_per_worker": PER_WORKER}) as node, \
            listener(node, max_connections=listener_cap) as port:
        flood, answers = [], []
        for _ in range(3 * listener_cap):
            flood.append(opened := await tls(node, port, "w1"))
            answers.append(await call_on(opened))
        assert [a.status for a in answers[:PER_WORKER]] == [200] * PER_WORKER
        past = answers[PER_WORKER:]
        assert set(past) == {(429, "too_many_connections", True, True)}, past
        assert node.daemon.gateway.controls.connections("w1") == PER_WORKER
        other = await tls(node, port, "w2")  # while w1 still holds its share and keeps flooding
        assert await call_on(other) == Raw(200, None, False)
        assert refusals(node, "too_many_connections") == len(past)
        for opened in [*flood, other]:
            close(opened)


async def test_an_identity_holds_at_most_max_control_streams_the_oldest_closed_for_a_new_one(
        make_node: MakeNode) -> None:
    async with make_node(gateway={**AUTO, "max_control_streams": 2}) as node:
        remotes = [node.remote("w1") for _ in range(3)]
        streams = []
        for remote in remotes:
            streams.append(stream := await open_control(remote))
            assert await stream.next() == ("worker", {"state": "enabled"})
        assert await streams[0].next() is None  # the oldest ended for the third
        controls = node.daemon.gateway.controls
        assert controls.open_streams() == 2
        assert refusals(node, "control_streams") == 1
        await node.submit()  # the two left are served
        assert [await s.next() for s in streams[1:]] == [("wake", {"n": 1})] * 2


async def test_a_disabled_worker_opens_no_control_stream(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        w1 = node.remote("w1")
        assert (await w1.acquire()).status == 200  # enrolled
        assert (await node.call("PATCH", "/v1/workers/w1", {"state": "disabled"})).status == 200
        response = await w1.session.get(w1.url + "/w1/control")
        assert (response.status, (await response.json())["error"]["code"]) == (403, "worker_disabled")
        assert node.daemon.gateway.controls.open_streams() == 0
        assert (await w1.acquire()).body["worker_state"] == "disabled"  # its other calls are served
        await node.enable("w1")
        assert await (await open_control(w1)).next() == ("worker", {"state": "enabled"})


async def test_a_revoked_worker_is_closed_after_its_403_and_its_silent_connection_is_not_held(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        port = int(node.w1.rpartition(":")[2])
        assert (await node.remote("w1").acquire()).status == 200  # enrolled
        quiet = await tls(node, port)  # open, and silent, when the revoke comes
        assert (await node.call("POST", "/v1/workers/w1/revoke")).status == 202
        assert await closed_soon(quiet[0])
        close(quiet)
        assert await call_on(await tls(node, port)) == Raw(403, "worker_revoked", True, True)
        silent = await tls(node, port)  # it sends nothing: not kept for the header deadline
        assert await closed_soon(silent[0])
        close(silent)
        assert await call_on(await tls(node, port)) == Raw(403, "worker_revoked", True, True)  # one that asks


async def test_a_pending_worker_is_closed_after_its_403(make_node: MakeNode) -> None:
    async with make_node() as node:  # manual enrollment
        port = int(node.w1.rpartition(":")[2])
        opened = await tls(node, port)
        assert await call_on(opened) == Raw(403, "worker_pending", True, True)
        assert await call_on(opened, "/w1/control") == Raw(None, None, True)  # nothing more on it
        assert node.daemon.gateway.controls.connections("w1") == 0 or await _forgotten(node, "w1")


async def _forgotten(node: Node, identity: str) -> bool:
    with anyio.fail_after(AT_ONCE_S):
        while node.daemon.gateway.controls.connections(identity):
            await anyio.sleep(0.02)
    return True


async def test_a_reload_closes_the_connections_and_streams_of_the_ca_it_removed_not_of_one_it_kept(
        make_node: MakeNode, tmp_path: Path, lab: pki.Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routes, "KEEP_ALIVE_S", 0.2)  # an open stream's certificate checked this often
    settings = gateway_settings(tmp_path, lab, gateway=AUTO)
    config = tmp_path / "gateway.toml"
    base = {name: getattr(settings, name).model_dump(mode="json")
            for name in ("node", "store", "api", "pool", "guards")}
    gateway = settings.gateway.model_dump(mode="json")
    write_config(config, {**base, "gateway": gateway})
    new_lab = make_lab(tmp_path / "new", ["w1"])
    both = tmp_path / "both-cas.pem"
    both.write_bytes(lab.ca_file.read_bytes() + new_lab.ca_file.read_bytes())
    async with make_node(load(config), config_path=config) as node:
        port = int(node.w1.rpartition(":")[2])
        old = await tls(node, port)
        assert (await call_on(old)).status == 200
        stream = await open_control(node.remote("w1"))
        assert await stream.next() == ("worker", {"state": "enabled"})
        write_config(config, {**base, "gateway": {**gateway, "client_ca_file": str(both)}})
        await node.daemon.reload()
        assert (await call_on(old)).status == 200  # its CA is still there: it carries on
        write_config(config, {**base, "gateway": {**gateway, "client_ca_file": str(new_lab.ca_file)}})
        await node.daemon.reload()
        assert await call_on(old) == Raw(403, "certificate_untrusted", True, True)
        assert await stream.next(timeout_s=AT_ONCE_S) is None  # the stream is closed too
        assert refusals(node, "certificate_untrusted") == 2
        fresh_context = client_context(new_lab, "w1")
        fresh_context.load_verify_locations(cafile=str(lab.ca_file))  # the gateway's own certificate is of the old
        fresh = node.remote(context=fresh_context)  # a certificate of the new CA is served, once the operator
        assert (await node.call("PATCH", "/v1/workers/w1", {"reset_issuer": True})).status == 200  # lets it bind
        assert (await fresh.acquire()).status == 200
        close(old)


async def test_a_dropped_control_stream_is_one_info_line_and_no_traceback(
        make_node: MakeNode, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "tidepool.gateway")  # the INFO line is what is asserted, run alone or not
    async with make_node(gateway=AUTO) as node:
        controls = node.daemon.gateway.controls
        for drop in ("abort", "close"):
            w1 = node.remote("w1")
            stream = await open_control(w1)
            assert await stream.next() == ("worker", {"state": "enabled"})
            caplog.clear()
            transport = stream.response.connection.transport if stream.response.connection else None
            assert transport is not None
            transport.abort() if drop == "abort" else transport.close()
            await node.submit()  # a wake for the stream: written to a connection that is gone
            with anyio.fail_after(AT_ONCE_S + routes.KEEP_ALIVE_S):
                while controls.open_streams():
                    await anyio.sleep(0.02)
            await anyio.sleep(0.2)  # what aiohttp would log once the handler returned
            records = [r for r in caplog.records if r.name.startswith(("tidepool", "aiohttp"))
                       and ("control" in r.getMessage() or r.exc_info or r.levelno >= logging.WARNING)]
            assert [(r.levelno, r.exc_info) for r in records] == [(logging.INFO, None)], \
                [r.getMessage() for r in records]
            assert records[0].getMessage().startswith("worker w1 control stream closed after ")
            assert records[0].getMessage().endswith(": dropped by the worker")
            await w1.close()


async def test_a_control_stream_whose_certificate_expires_is_closed(
        make_node: MakeNode, lab: pki.Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routes, "KEEP_ALIVE_S", 0.2)  # an open stream's certificate checked this often
    async with make_node(gateway=AUTO) as node:
        remote = Remote(node.w1, expiring_context(lab))  # a day's certificate, 2 s of it left
        try:
            stream = await open_control(remote)
            assert await stream.next() == ("worker", {"state": "enabled"})
            assert await stream.next(timeout_s=2 + AT_ONCE_S) is None
            assert refusals(node, "certificate_expired") == 1
        finally:
            await remote.close()
