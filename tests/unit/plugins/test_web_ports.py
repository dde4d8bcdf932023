"""probe_web_ports against real loopback servers: a plain HTTP port, a TLS port, a closed port, a silent one."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import pytest
from aiohttp import web

from tests.lab import make_lab
from tests.web_servers import LOOPBACK, serving, tls_context
from tidepool.errors import InvalidArgument
from tidepool.gateway import pki
from tidepool.plugins.netprobe import probe_web_ports

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> pki.Lab:
    return make_lab(tmp_path_factory.mktemp("lab"))


@pytest.fixture
async def web_ports(lab: pki.Lab) -> AsyncIterator[tuple[int, int]]:
    """(plain HTTP port, TLS port)."""
    async with serving() as [plain], serving(tls_context(lab)) as [tls]:
        yield plain, tls


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


async def test_each_port_is_reported_by_the_scheme_that_answered_it(web_ports: tuple[int, int]) -> None:
    plain, tls = web_ports
    shut = closed_port()

    summary, answers = await probe_web_ports(LOOPBACK, [shut, tls, plain], verify_tls=False, timeout_s=5)

    ports = summary["ports"]
    assert summary["target"] == LOOPBACK and summary["web"] == sorted([plain, tls])
    assert ports[str(plain)] | {"errors": None} == {"scheme": "http", "url": f"http://{LOOPBACK}:{plain}/",
                                                   "status": 200, "server": "probe-http", "errors": None}
    assert list(ports[str(plain)]["errors"]) == ["https"]  # TLS was tried first, and said why it failed
    assert ports[str(tls)] == {"scheme": "https", "url": f"https://{LOOPBACK}:{tls}/", "status": 200,
                               "server": "probe-https", "errors": {}}
    assert ports[str(shut)]["scheme"] is None and ports[str(shut)]["status"] is None
    assert {s: e["code"] for s, e in ports[str(shut)]["errors"].items()} == {"https": "http_error",
                                                                             "http": "http_error"}
    assert [(a["port"], a["scheme"], a["status"]) for a in answers] == sorted([(plain, "http", 200),
                                                                              (tls, "https", 200)])
    by_port = {a["port"]: a for a in answers}
    assert by_port[plain]["tls"] is None and by_port[plain]["headers"]["server"] == "probe-http"
    assert by_port[tls]["tls"]["cert_subject"] == "CN=localhost"
    assert by_port[tls]["tls"]["cert_issuer"].startswith("O=tidepool, CN=tidepool lab CA")


async def test_a_certificate_that_fails_verification_is_a_tls_answer_without_status(
        web_ports: tuple[int, int]) -> None:
    _plain, tls = web_ports
    summary, answers = await probe_web_ports(LOOPBACK, [tls], verify_tls=True, timeout_s=5)
    entry = summary["ports"][str(tls)]
    assert (entry["scheme"], entry["status"], summary["web"], answers) == ("https", None, [], [])
    assert list(entry["errors"]) == ["https"]  # plain HTTP is not tried on a port that speaks TLS
    assert "certificate verify failed" in entry["errors"]["https"]["message"]


async def test_a_certificate_of_a_trusted_ca_is_verified(web_ports: tuple[int, int], lab: pki.Lab,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(lab.ca_file))  # trust the lab CA, for this test only
    _plain, tls = web_ports
    summary, _answers = await probe_web_ports(LOOPBACK, [tls], verify_tls=True, timeout_s=5)
    assert summary["ports"][str(tls)]["status"] == 200 and summary["web"] == [tls]


async def test_a_port_that_never_answers_times_out_on_each_scheme_within_its_own_timeout() -> None:
    async with await anyio.create_tcp_listener(local_host=LOOPBACK) as silent:  # accepts, never reads
        port = silent.extra(anyio.abc.SocketAttribute.local_port)
        summary, answers = await probe_web_ports(LOOPBACK, [port], timeout_s=0.3)
    entry = summary["ports"][str(port)]
    assert entry["scheme"] is None and answers == []
    assert {s: e["code"] for s, e in entry["errors"].items()} == {"https": "timeout", "http": "timeout"}


async def test_no_more_ports_than_the_cap_are_probed_at_once() -> None:
    cap, inside, seen = 2, [0], [0]
    both_in = anyio.Event()

    async def paired(request: web.Request) -> web.Response:
        # The first requests wait for each other (with fewer at once than the cap they would hang), then
        # hold on for a few hundred turns of the event loop: time enough for the probe's other requests to
        # come in, if it let more through than the cap.
        inside[0] += 1
        seen[0] = max(seen[0], inside[0])
        if inside[0] == cap:
            both_in.set()
        await both_in.wait()
        for _ in range(300):
            await anyio.lowlevel.checkpoint()
        inside[0] -= 1
        return web.Response(text="ok")

    async with serving(handler=paired, sites=6) as ports:
        summary, _ = await probe_web_ports(LOOPBACK, ports, concurrency=cap, timeout_s=5, verify_tls=False)
    assert summary["web"] == sorted(ports) and seen[0] == cap


@pytest.mark.parametrize(("kwargs", "named"), [({"concurrency": 0}, "concurrency"), ({"timeout_s": 0}, "timeout_s"),
                                               ({"target": "-oN x"}, "payload.target")])
async def test_bad_limits_are_refused_naming_them(kwargs: dict[str, object], named: str) -> None:
    arguments: dict[str, object] = {"target": LOOPBACK, "ports": [80], **kwargs}
    with pytest.raises(InvalidArgument) as caught:
        await probe_web_ports(**arguments)  # type: ignore[arg-type]
    assert caught.value.field == named

