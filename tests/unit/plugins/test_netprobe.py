"""Tests of tidepool.plugins.netprobe against real sockets and real HTTP(S) servers on loopback only."""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import anyio
import psutil
import pytest
from aiohttp import web

from tidepool.errors import InvalidArgument, PluginError
from tidepool.plugins.netprobe import http_probe, tcp, tcp_connect, validate_ports, validate_target

pytestmark = pytest.mark.timeout(30)

LOOPBACK = "127.0.0.1"


# --- validate_target / validate_ports --------------------------------------------------------------

ACCEPTED_TARGETS = [
    "127.0.0.1",
    "10.0.0.255",
    "::1",
    "2001:db8::1",
    "::ffff:192.0.2.1",
    "fe80::1%eth0",
    "fe80::1%br-1",
    "fe80::1%2",
    "localhost",
    "scanme.example.org",
    "a-b.c-d.example",
    "xn--bcher-kva.de",
    "EXAMPLE.COM",
    "host1.example",
    "a" * 63 + ".example",
    ".".join(["a" * 63] * 3) + "." + "b" * 61,  # 253 characters, the maximum
]

REFUSED_TARGETS = [
    "",
    "-oN /etc/cron.d/x",
    "-iL",
    "--script=x",
    "host name",
    " 127.0.0.1",
    "127.0.0.1 ",
    "host\x00name",
    "host\nname",
    "http://example.com",
    "example.com/path",
    "example.com:80",
    "user@example.com",
    "[::1]",
    "fe80::1%a b",
    "fe80::1%-oN",
    "bücher.de",
    "-leading.example",
    "trailing-.example",
    "under_score.example",
    "double..dot",
    "trailing.dot.",
    ".leading.dot",
    "a" * 64 + ".example",
    ".".join(["a" * 63] * 3) + "." + "b" * 62,  # 254 characters
    "1.2.3.4.5",
    "010.0.0.1",
    "0x7f000001",
    "256.1.1.1",
    "1.2.3.4/32",
    "$(reboot)",
    "a;b",
]


@pytest.mark.parametrize("value", ACCEPTED_TARGETS)
def test_validate_target_accepts_addresses_and_strict_host_names(value: str) -> None:
    assert validate_target(value) == value


@pytest.mark.parametrize("value", REFUSED_TARGETS)
def test_validate_target_refuses_everything_else_naming_the_field(value: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate_target(value, field="payload.host")
    assert caught.value.field == "payload.host"
    assert str(caught.value).startswith("payload.host: ")
    assert caught.value.code == "invalid_argument"
    assert caught.value.retryable is False


@pytest.mark.parametrize("value", [None, 127, b"127.0.0.1", ["127.0.0.1"], True])
def test_validate_target_refuses_non_strings_with_the_default_field(value: object) -> None:
    with pytest.raises(InvalidArgument, match="must be a string") as caught:
        validate_target(value)
    assert caught.value.field == "payload.target"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [80, 443]),
        ([22], [22]),
        ([1, 65535], [1, 65535]),
        ((443, 80), [443, 80]),
        ([80, 443, 80, 22, 443], [80, 443, 22]),
        (list(range(1, 65536)), list(range(1, 65536))),
    ],
)
def test_validate_ports_accepts_port_lists(value: object, expected: list[int]) -> None:
    assert validate_ports(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        [],
        [0],
        [65536],
        [-1],
        [True],
        [80, False],
        ["80"],
        [80.0],
        [None],
        "80",
        80,
        {80: "http"},
        [80] * 65536,
    ],
)
def test_validate_ports_refuses_bad_lists_naming_the_field(value: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate_ports(value, field="payload.scan_ports")
    assert caught.value.field == "payload.scan_ports"
    assert str(caught.value).startswith("payload.scan_ports: ")


# --- tcp_connect: loopback fixtures -----------------------------------------------------------------


@pytest.fixture
def open_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen(16)
        yield listener.getsockname()[1]


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
    return port  # bound then closed: nothing listens there, a SYN gets a RST


@pytest.fixture
def closed_port() -> int:
    return _unused_port()


def _full_backlog_listener() -> tuple[socket.socket, socket.socket]:
    """A listener that never accepts and whose accept queue is full, so Linux drops further SYNs."""
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(0)  # the queue holds one connection; the next SYN is dropped (no RST)
    filler = socket.create_connection(listener.getsockname(), timeout=2)
    return listener, filler


@pytest.fixture
def silent_ports() -> Iterator[list[int]]:
    pairs = [_full_backlog_listener() for _ in range(3)]
    yield [listener.getsockname()[1] for listener, _ in pairs]
    for listener, filler in pairs:
        filler.close()
        listener.close()


def _syn_sent_to(ports: set[int]) -> int:
    connections = psutil.Process().net_connections(kind="tcp")
    return sum(
        1 for c in connections if c.status == psutil.CONN_SYN_SENT and c.raddr and c.raddr.port in ports
    )


async def _until_in_flight(ports: set[int], *, count: int) -> None:
    """Wait until `count` of our connects to `ports` wait for an answer (kernel state: no event)."""
    for _ in range(1000):
        if _syn_sent_to(ports) >= count:
            return
        await anyio.sleep(0.005)
    raise AssertionError(f"fewer than {count} connects to {sorted(ports)} ever were in flight")


# --- tcp_connect ------------------------------------------------------------------------------------


async def test_tcp_connect_reports_open_closed_and_filtered(
    open_port: int, closed_port: int, silent_ports: list[int]
) -> None:
    result = await tcp_connect(LOOPBACK, [closed_port, open_port, silent_ports[0]], connect_timeout_s=0.3)
    assert result["target"] == LOOPBACK
    assert result["address"] == LOOPBACK
    assert result["ports"] == {
        str(open_port): "open",
        str(closed_port): "closed",
        str(silent_ports[0]): "filtered",
    }
    assert list(result["ports"]) == [str(p) for p in sorted([open_port, closed_port, silent_ports[0]])]
    assert result["open"] == [open_port]


async def test_tcp_connect_resolves_a_host_name_once_and_reports_the_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    family, _, _, _, sockaddr = socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)[0]
    calls: list[str] = []
    real_getaddrinfo = anyio.getaddrinfo

    async def counting_getaddrinfo(host: str, port: Any, **kwargs: Any) -> Any:
        calls.append(host)
        return await real_getaddrinfo(host, port, **kwargs)

    monkeypatch.setattr(anyio, "getaddrinfo", counting_getaddrinfo)
    with socket.socket(family) as listener:
        listener.bind((sockaddr[0], 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        result = await tcp_connect("localhost", [port, _unused_port()])
    assert calls == ["localhost"]
    assert result["target"] == "localhost"
    assert result["address"] == sockaddr[0]
    assert result["open"] == [port]


async def test_tcp_connect_scans_ipv6_loopback(unavailable: Callable[[str], NoReturn]) -> None:
    try:
        listener = socket.socket(socket.AF_INET6)
        listener.bind(("::1", 0))
    except OSError:
        unavailable("no IPv6 loopback here")
    with listener:
        listener.listen(16)
        port = listener.getsockname()[1]
        result = await tcp_connect("::1", [port])
    assert result["ports"] == {str(port): "open"}


async def test_tcp_connect_unresolvable_name_raises_resolve_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    # A real lookup of an unknown name would ask a DNS server, which is not on loopback.
    async def no_such_name(host: str, port: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(anyio, "getaddrinfo", no_such_name)
    with pytest.raises(PluginError) as caught:
        await tcp_connect("no-such-host.invalid", [80])
    assert caught.value.code == "resolve_failed"
    assert caught.value.retryable is False
    assert "no-such-host.invalid" in str(caught.value)


async def test_tcp_connect_bounds_connects_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    real_probe = tcp._probe_port
    in_flight = peak = 0

    async def counting_probe(*args: Any) -> str:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await anyio.sleep(0.01)  # hold the slot so that overlapping probes would be seen
            return await real_probe(*args)
        finally:
            in_flight -= 1

    monkeypatch.setattr(tcp, "_probe_port", counting_probe)
    ports = [_unused_port() for _ in range(10)]
    result = await tcp_connect(LOOPBACK, ports, concurrency=2)
    assert peak == 2
    assert set(result["ports"]) == {str(p) for p in ports}


async def test_cancelling_tcp_connect_returns_promptly_and_leaves_no_socket(silent_ports: list[int]) -> None:
    process = psutil.Process()
    fds_before = process.num_fds()
    ports = [*silent_ports, *(_unused_port() for _ in range(50))]

    async def scan() -> None:
        await tcp_connect(LOOPBACK, ports, concurrency=3, connect_timeout_s=60.0)

    with anyio.fail_after(5):  # without working cancellation the 60 s connects would hold it
        async with anyio.create_task_group() as tg:
            tg.start_soon(scan)
            await _until_in_flight(set(silent_ports), count=3)
            tg.cancel_scope.cancel()
    gc.collect()  # an unclosed socket would raise ResourceWarning here (warnings are errors)
    assert _syn_sent_to(set(silent_ports)) == 0
    assert process.num_fds() == fds_before


async def test_tcp_connect_raises_plugin_error_not_a_group_on_local_failure(
    monkeypatch: pytest.MonkeyPatch, open_port: int
) -> None:
    def no_more_files(*args: Any, **kwargs: Any) -> socket.socket:
        raise OSError(24, "Too many open files")

    ports = [open_port, _unused_port(), _unused_port()]
    monkeypatch.setattr(socket, "socket", no_more_files)
    with pytest.raises(PluginError, match="open-files limit") as caught:
        await tcp_connect(LOOPBACK, ports, concurrency=3)  # three workers fail at once
    assert caught.value.code == "socket_error"


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"target": "-oN x"}, "payload.target"),
        ({"ports": [0]}, "payload.ports"),
        ({"concurrency": 0}, "concurrency"),
        ({"concurrency": True}, "concurrency"),
        ({"connect_timeout_s": 0}, "connect_timeout_s"),
        ({"connect_timeout_s": float("nan")}, "connect_timeout_s"),
    ],
)
async def test_tcp_connect_refuses_bad_arguments_before_any_network(
    kwargs: dict[str, Any], named: str
) -> None:
    arguments: dict[str, Any] = {"target": LOOPBACK, "ports": [80], **kwargs}
    with pytest.raises(InvalidArgument) as caught:
        await tcp_connect(**arguments)
    assert caught.value.field == named


# --- http_probe: servers ---------------------------------------------------------------------------


@dataclass
class _Server:
    base: str
    slow_entered: asyncio.Event = field(default_factory=asyncio.Event)
    release_slow: asyncio.Event = field(default_factory=asyncio.Event)


def _app(server: _Server) -> web.Application:
    async def index(request: web.Request) -> web.Response:
        response = web.Response(text="hello")
        response.headers.add("X-Multi", "one")
        response.headers.add("X-Multi", "two")
        response.headers["X-Probe"] = "Yes"
        return response

    async def hop1(request: web.Request) -> web.Response:
        raise web.HTTPFound("/hop2")

    async def hop2(request: web.Request) -> web.Response:
        raise web.HTTPMovedPermanently(str(request.url.with_path("/")))

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (200 * 1024))

    async def loop(request: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    async def to_ftp(request: web.Request) -> web.Response:
        raise web.HTTPFound("ftp://example.invalid/file")

    async def slow(request: web.Request) -> web.Response:
        server.slow_entered.set()
        await server.release_slow.wait()
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_get("/hop1", hop1)
    app.router.add_get("/hop2", hop2)
    app.router.add_get("/big", big)
    app.router.add_get("/loop", loop)
    app.router.add_get("/to-ftp", to_ftp)
    app.router.add_get("/slow", slow)
    return app


async def _serve(ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[_Server]:
    server = _Server(base="")
    runner = web.AppRunner(_app(server))
    await runner.setup()
    site = web.TCPSite(runner, LOOPBACK, 0, ssl_context=ssl_context)
    await site.start()
    server.base = f"{'https' if ssl_context else 'http'}://{LOOPBACK}:{runner.addresses[0][1]}"
    try:
        yield server
    finally:
        server.release_slow.set()
        await runner.cleanup()


@pytest.fixture
async def http_server() -> AsyncIterator[_Server]:
    async for server in _serve():
        yield server


@pytest.fixture
def http_base(http_server: _Server) -> str:
    return http_server.base


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("tls")
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30",
            "-subj", "/CN=localhost", "-addext", f"subjectAltName=IP:{LOOPBACK}",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=20,
    )  # fmt: skip
    return key, cert


@pytest.fixture
async def https_base(self_signed: tuple[Path, Path]) -> AsyncIterator[str]:
    key, cert = self_signed
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    async for server in _serve(context):
        yield server.base


# --- http_probe -------------------------------------------------------------------------------------


async def test_http_probe_reports_status_and_lowercased_joined_headers(http_base: str) -> None:
    result = await http_probe(f"{http_base}/")
    assert result["url"] == f"{http_base}/"
    assert result["final_url"] == f"{http_base}/"
    assert result["status"] == 200
    assert result["headers"]["x-multi"] == "one, two"
    assert result["headers"]["x-probe"] == "Yes"
    assert all(name == name.lower() for name in result["headers"])
    assert result["redirects"] == []
    assert result["tls"] is None
    assert result["body_bytes"] == len("hello")
    assert result["elapsed_s"] >= 0


async def test_http_probe_records_a_two_hop_redirect_chain(http_base: str) -> None:
    result = await http_probe(f"{http_base}/hop1")
    assert result["redirects"] == [
        {"url": f"{http_base}/hop1", "status": 302, "location": "/hop2"},
        {"url": f"{http_base}/hop2", "status": 301, "location": f"{http_base}/"},
    ]
    assert result["final_url"] == f"{http_base}/"
    assert result["status"] == 200


async def test_http_probe_reads_at_most_64_kib_of_the_body(http_base: str) -> None:
    result = await http_probe(f"{http_base}/big")
    assert result["status"] == 200
    assert result["body_bytes"] == 64 * 1024
    assert "body" not in result


async def test_http_probe_redirect_loop_raises_too_many_redirects(http_base: str) -> None:
    with pytest.raises(PluginError, match="more than 3 times") as caught:
        await http_probe(f"{http_base}/loop", max_redirects=3)
    assert caught.value.code == "too_many_redirects"
    assert caught.value.retryable is False


async def test_http_probe_with_zero_redirects_allowed_refuses_the_first(http_base: str) -> None:
    with pytest.raises(PluginError) as caught:
        await http_probe(f"{http_base}/hop1", max_redirects=0)
    assert caught.value.code == "too_many_redirects"


async def test_http_probe_redirect_to_another_scheme_ends_the_chain(http_base: str) -> None:
    result = await http_probe(f"{http_base}/to-ftp")
    assert result["status"] == 302
    assert result["redirects"] == []
    assert result["headers"]["location"] == "ftp://example.invalid/file"


async def test_http_probe_connection_refused_is_http_error(closed_port: int) -> None:
    with pytest.raises(PluginError, match="failed") as caught:
        await http_probe(f"http://{LOOPBACK}:{closed_port}/")
    assert caught.value.code == "http_error"
    assert caught.value.retryable is True


async def test_http_probe_tls_to_a_plain_server_says_why_without_a_python_repr(http_base: str) -> None:
    with pytest.raises(PluginError) as caught:
        await http_probe(http_base.replace("http://", "https://", 1) + "/")
    message = str(caught.value)
    assert "WRONG_VERSION_NUMBER" in message and f"{LOOPBACK}:" in message, message
    assert " object at 0x" not in message and "ssl:" not in message, message


async def test_http_probe_timeout_is_plugin_error_timeout(http_base: str) -> None:
    with pytest.raises(PluginError, match=r"within 0\.2s") as caught:
        await http_probe(f"{http_base}/slow", timeout_s=0.2)
    assert caught.value.code == "timeout"
    assert isinstance(caught.value.__cause__, TimeoutError)


async def test_cancelling_http_probe_returns_promptly(http_server: _Server) -> None:
    with anyio.fail_after(5):  # the probe's own timeout (10 s) would be too late
        async with anyio.create_task_group() as tg:
            tg.start_soon(http_probe, f"{http_server.base}/slow")
            await http_server.slow_entered.wait()
            tg.cancel_scope.cancel()
    gc.collect()  # an unclosed session or transport would raise ResourceWarning here


async def test_http_probe_reuses_a_passed_session_and_leaves_it_open(http_base: str) -> None:
    async with aiohttp.ClientSession() as session:
        first = await http_probe(f"{http_base}/", session=session)
        second = await http_probe(f"{http_base}/hop1", session=session)
        assert not session.closed
        assert session.connector is not None
        assert first["status"] == second["status"] == 200


@pytest.mark.parametrize(
    "url",
    [
        "",
        "ftp://127.0.0.1/",
        "file:///etc/passwd",
        "127.0.0.1:80",
        "http://",
        "http:///path",
        "http://127.0.0.1:99999/",
        "http://127.0.0.1:0/",
        "http://-oN/",
        "http://user:secret@127.0.0.1/",
        "http://127.0.0.1/a b",
        "http://127.0.0.1/\x00",
        "http://[zz]/",
        "javascript:alert(1)",
        "http://" + "a" * 9000,
        None,
        42,
    ],
)
async def test_http_probe_refuses_malformed_urls(url: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await http_probe(url)  # type: ignore[arg-type]
    assert caught.value.field == "payload.url"


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"timeout_s": 0}, "timeout_s"), ({"max_redirects": -1}, "max_redirects")],
)
async def test_http_probe_refuses_bad_limits(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await http_probe(f"http://{LOOPBACK}/", **kwargs)
    assert caught.value.field == named


async def test_http_probe_reports_tls_facts_without_verification(https_base: str) -> None:
    result = await http_probe(f"{https_base}/", verify_tls=False)
    tls = result["tls"]
    assert result["status"] == 200
    assert tls["version"] in ("TLSv1.2", "TLSv1.3")
    assert tls["cipher"]
    assert tls["cert_subject"] == "CN=localhost"
    assert tls["cert_issuer"] == "CN=localhost"
    assert 29.9 < tls["cert_days_left"] <= 30.0
    not_after = time.strptime(tls["cert_not_after"], "%Y-%m-%dT%H:%M:%SZ")
    assert abs(time.mktime(not_after) - time.mktime(time.gmtime(time.time() + 30 * 86400))) < 600


async def test_http_probe_refuses_a_self_signed_certificate_when_verifying(https_base: str) -> None:
    with pytest.raises(PluginError) as caught:
        await http_probe(f"{https_base}/", verify_tls=True)
    assert caught.value.code == "http_error"
    assert caught.value.retryable is False
    assert "certificate verify failed" in str(caught.value)
    assert "verify_tls=false" in str(caught.value)


async def test_http_probe_reports_tls_facts_of_a_verified_certificate(
    https_base: str, self_signed: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(self_signed[1]))  # trust our own CA, for this test only
    result = await http_probe(f"{https_base}/hop1", verify_tls=True)
    assert result["status"] == 200
    assert len(result["redirects"]) == 2
    assert result["tls"]["cert_subject"] == "CN=localhost"
    assert 29.9 < result["tls"]["cert_days_left"] <= 30.0
