"""The /w1 listener's own protections, over real TLS: a client that does not finish its handshake or its
request's headers in time is cut off while the others are served, and connections past the cap are closed at
once, before their TLS handshake, while those within it are served. The deadline and the cap are the
listener's arguments here (a second listener on the node's gateway), so that they show in a second and with
a handful of connections."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

import anyio
import pytest

from tidepool.gateway.listener import HANDSHAKE_TIMEOUT_S, MAX_HANDSHAKES_PER_ADDRESS, connection_cap, serve_gateway
from tidepool.gateway.tls import Credentials

from ..conftest import free_port
from .conftest import AUTO, MakeNode, Node, client_context

HEADER_TIMEOUT_S = 1.0
CUT_OFF_S = 10 * HEADER_TIMEOUT_S  # far past the deadline, far short of any other timeout that would close it
SLOW_BYTE_S = 0.25  # a trickle: a byte this often, never a pause long enough to look idle
AT_ONCE_S = 1.0  # far short of the handshake deadline (HANDSHAKE_TIMEOUT_S)

Opened = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@asynccontextmanager
async def listener(node: Node, **limits: float) -> AsyncIterator[int]:
    """A second /w1 listener of the node's gateway with these limits; its port."""
    port = free_port()
    serve = partial(serve_gateway, node.daemon.gateway, Credentials(node.daemon.settings.gateway),
                    f"127.0.0.1:{port}", **limits)
    async with anyio.create_task_group() as tg:
        await tg.start(serve)
        yield port
        tg.cancel_scope.cancel()


async def tls(node: Node, port: int, worker: str = "w1") -> Opened:
    return await asyncio.open_connection("127.0.0.1", port, ssl=client_context(node.lab, worker))


async def acquire_on(opened: Opened) -> int | None:
    """POST /w1/acquire on a connection, its answer read whole; the answer's status (None: the connection was
    closed unanswered)."""
    reader, writer = opened
    body = json.dumps({"types": ["noop"], "max": 1, "wait_s": 0}).encode()
    try:
        writer.write(b"POST /w1/acquire HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        with anyio.fail_after(CUT_OFF_S):
            head = await reader.readuntil(b"\r\n\r\n")
            status, *headers = head.decode().split("\r\n")
            length = next(int(h.split(":")[1]) for h in headers if h.lower().startswith("content-length:"))
            await reader.readexactly(length)
    except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
        return None
    return int(status.split()[1])


async def closed_by_the_gateway(reader: asyncio.StreamReader) -> bool:
    """Whether the gateway closes the connection within CUT_OFF_S, having answered nothing."""
    try:
        with anyio.fail_after(CUT_OFF_S):
            return await reader.read(1) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True


def close(opened: Opened) -> None:
    opened[1].transport.abort()


async def served_meanwhile(node: Node, port: int, until: Callable[[], bool]) -> list[int | None]:
    """The answers to another worker's acquires on its own connection, one after another, until `until`."""
    answers = []
    w2 = await tls(node, port, "w2")
    try:
        while not until():
            answers.append(await acquire_on(w2))
            await anyio.sleep(0.05)
    finally:
        close(w2)
    return answers


async def test_a_client_trickling_its_headers_is_cut_off_while_others_are_served(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node, listener(node, header_timeout_s=HEADER_TIMEOUT_S) as port:
        await node.remote("w2").acquire()  # enrolled
        request = b"POST /w1/acquire HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" * 4
        reader, writer = await tls(node, port)
        outcome: dict[str, int | bool] = {"sent": 0}

        async def trickle() -> None:
            try:
                for byte in request:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    outcome["sent"] = int(outcome["sent"]) + 1
                    await anyio.sleep(SLOW_BYTE_S)
            except (ConnectionError, ssl.SSLError):
                pass  # cut off mid-write

        served: list[int | None] = []

        async def others() -> None:
            served.extend(await served_meanwhile(node, port, until=lambda: "closed" in outcome))

        async with anyio.create_task_group() as tg:
            tg.start_soon(trickle)
            tg.start_soon(others)
            outcome["closed"] = await closed_by_the_gateway(reader)
        assert outcome["closed"] and int(outcome["sent"]) < len(request), outcome
        assert served and set(served) == {200}, served  # the other worker was answered all along
        writer.transport.abort()


async def test_a_client_that_never_finishes_its_handshake_is_cut_off(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node, listener(node, header_timeout_s=HEADER_TIMEOUT_S) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # TCP only: no ClientHello
        assert await closed_by_the_gateway(reader)
        writer.close()
        finishing = await tls(node, port)
        assert await acquire_on(finishing) == 200  # a client that does finish it is served
        close(finishing)


async def test_a_silent_connection_is_cut_off_at_the_handshake_deadline_not_the_header_one(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node, listener(node) as port:  # the header deadline left at 10 s
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # TCP only: no ClientHello
        with anyio.fail_after(HANDSHAKE_TIMEOUT_S + AT_ONCE_S):
            assert await closed_by_the_gateway(reader)
        writer.close()


async def test_one_address_of_silent_connections_cannot_take_the_listener_from_another(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node, \
            listener(node, max_connections=MAX_HANDSHAKES_PER_ADDRESS + 2) as port:
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_HANDSHAKES_PER_ADDRESS)]
        past = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for reader, _ in past:  # at once, not at the handshake deadline
            with anyio.fail_after(AT_ONCE_S):
                assert await closed_by_the_gateway(reader)
        other = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0),
                                              ssl=client_context(node.lab, "w1"), server_hostname="127.0.0.1")
        assert await acquire_on(other) == 200
        assert node.daemon.gateway.metrics.connections_refused.values[("handshakes_per_address",)] == 2
        for _, writer in [*silent, *past, other]:
            writer.transport.abort()


async def test_connections_past_the_cap_are_closed_before_their_handshake_and_those_within_it_served(
        make_node: MakeNode) -> None:
    cap = 3
    async with make_node(gateway=AUTO) as node, listener(node, max_connections=cap) as port:
        await node.remote("w1").acquire()  # enrolled
        within = [await tls(node, port) for _ in range(cap)]
        # TCP only, no ClientHello: within the cap it would wait for its handshake's deadline
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with anyio.fail_after(AT_ONCE_S):
            assert await closed_by_the_gateway(reader)  # at once, and not one byte of TLS was sent
        writer.close()
        with pytest.raises(OSError):  # a TLS client past the cap: its handshake never answered
            await tls(node, port)
        assert [await acquire_on(c) for c in within] == [200] * cap  # the connections it holds still serve
        refused = node.daemon.gateway.metrics.connections_refused.values[("listener_full",)]
        assert refused == 2
        close(within.pop())
        assert await _served_once_admitted(node, port) == 200  # a place came free
        for opened in within:
            close(opened)


async def test_the_full_listener_says_so_once_naming_itself(make_node: MakeNode,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    async with make_node(gateway=AUTO) as node, listener(node, max_connections=1) as port:
        held = await tls(node, port)
        for _ in range(5):
            with pytest.raises(OSError):
                await tls(node, port)
        full = [r.getMessage() for r in caplog.records if "connections are open" in r.getMessage()]
        assert full == ["gateway listener: 1 connections are open, the most it holds; new ones are closed at once"]
        close(held)


def refused_and_silent(node: Node, port: int) -> ssl.SSLSocket:
    """A connection of w1 past its identity's cap, its 429 read to the end; then the gateway's close is left
    unanswered and the socket open, as a client may. Blocking: Python's ssl client answers no close by itself."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=CUT_OFF_S)
    opened = client_context(node.lab, "w1").wrap_socket(raw, server_hostname="127.0.0.1")
    answer = b""
    while chunk := opened.recv(65536):
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 429 "), answer
    return opened


async def test_a_connection_refused_past_its_identitys_cap_keeps_its_place_until_its_socket_is_closed(
        make_node: MakeNode) -> None:
    async with make_node(gateway={**AUTO, "max_connections_per_worker": 1}) as node, \
            listener(node, max_connections=2) as port:
        held = await tls(node, port)
        assert await acquire_on(held) == 200
        silent = await anyio.to_thread.run_sync(refused_and_silent, node, port)
        with pytest.raises(OSError):  # two sockets are open, the cap: a third is closed before its handshake
            await tls(node, port, "w2")
        silent.close()
        assert await _served_once_admitted(node, port, "w2") == 200  # its place came free with its socket
        close(held)


async def _served_once_admitted(node: Node, port: int, worker: str = "w1") -> int | None:
    """An acquire's status on a new connection, tried again while the gateway closes them: a closed connection
    takes a moment to reach it."""
    with anyio.fail_after(CUT_OFF_S):
        while True:
            try:
                opened = await tls(node, port, worker)
            except OSError:  # still full: closed before its handshake
                await anyio.sleep(0.05)
                continue
            try:
                status = await acquire_on(opened)
            finally:
                close(opened)
            if status is not None:
                return status
            await anyio.sleep(0.05)


def test_max_connections_0_is_sized_from_the_open_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        assert connection_cap(0, pool_workers=16) == lowered - 512 - 4 * 16 - 256
        assert connection_cap(100, pool_workers=16) == 100  # a setting is taken as it is
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_the_nodes_listener_holds_gateway_max_connections(make_node: MakeNode) -> None:
    async with make_node(gateway={**AUTO, "max_connections": 2}) as node:
        port = int(node.w1.rpartition(":")[2])
        held = [await tls(node, port) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with anyio.fail_after(AT_ONCE_S):
            assert await closed_by_the_gateway(reader)
        writer.close()
        for opened in held:
            close(opened)
