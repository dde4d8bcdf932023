"""http_probe through the engine on every open port: after tcp_connect in one task, and as a step of its own
given the open ports in its payload, against a plain HTTP server, a TLS server and a closed port."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.lab import make_lab
from tests.web_servers import LOOPBACK, serving, tls_context
from tidepool.model import State
from tidepool.settings import TypeSettings
from tidepool.store.sqlite import SqliteStore

from .conftest import registry_of, running_node

pytestmark = pytest.mark.timeout(60)

TYPES = {"scan": TypeSettings(plugins=("tcp_connect", "http_probe")), "web": TypeSettings(plugins=("http_probe",))}


@pytest.fixture
async def ports(tmp_path: Path) -> AsyncIterator[tuple[int, int, int]]:
    """(plain HTTP, TLS, closed)."""
    lab = make_lab(tmp_path)
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        shut = int(sock.getsockname()[1])
    async with serving() as [plain], serving(tls_context(lab)) as [tls]:
        yield plain, tls, shut


async def test_a_scan_probes_each_port_it_found_open_tls_first(sqlite_store: SqliteStore, tmp_path: Path,
                                                               ports: tuple[int, int, int]) -> None:
    plain, tls, shut = ports
    async with running_node(sqlite_store, {}, registry=registry_of({}, TYPES), work_root=tmp_path) as node:
        task = await node.finished(await node.submit(
            "scan", {"target": LOOPBACK, "ports": [plain, tls, shut], "verify_tls": False, "timeout_s": 5}))

    assert task.state is State.COMPLETED, task.error
    scanned, *answers, summary = task.results
    assert scanned.plugin == "tcp_connect" and sorted(scanned.payload["open"]) == sorted([plain, tls])
    assert [(r.plugin, r.final, r.payload["port"], r.payload["scheme"], r.payload["status"]) for r in answers] == \
        sorted([("http_probe", False, plain, "http", 200), ("http_probe", False, tls, "https", 200)],
               key=lambda row: row[2])
    assert summary.plugin == "http_probe" and summary.final
    assert summary.payload["web"] == sorted([plain, tls])
    assert str(shut) not in summary.payload["ports"]  # closed: tcp_connect said so, nothing to probe
    assert summary.payload["ports"][str(tls)]["server"] == "probe-https"


async def test_a_probe_step_of_its_own_takes_the_open_ports_from_its_payload(
        sqlite_store: SqliteStore, tmp_path: Path, ports: tuple[int, int, int]) -> None:
    plain, tls, shut = ports
    async with running_node(sqlite_store, {}, registry=registry_of({}, TYPES), work_root=tmp_path) as node:
        task = await node.finished(await node.submit(
            "web", {"target": LOOPBACK, "ports": [1], "open_ports": [plain, tls, shut], "verify_tls": False}))
        nothing_open = await node.finished(await node.submit("web", {"target": LOOPBACK, "open_ports": []}))
        bad = await node.finished(await node.submit("web", {"target": LOOPBACK, "open_ports": ["80"]}))

    assert task.state is State.COMPLETED, task.error
    entries = task.results[-1].payload["ports"]
    assert {port: entry["scheme"] for port, entry in entries.items()} == {
        str(plain): "http", str(tls): "https", str(shut): None}  # payload.ports gave way to what was found open
    assert nothing_open.state is State.COMPLETED
    assert [r.payload for r in nothing_open.results] == [{"target": LOOPBACK, "ports": {}, "web": []}]
    assert bad.state is State.FAILED and bad.error is not None
    assert (bad.error.code, bad.error.message.split(":")[0]) == ("invalid_argument", "payload.open_ports")
