"""A gateway node in this process (the real Daemon: its /v1 API on loopback HTTP, its /w1 listener on mutual
TLS) with certificates made by `tidepool pki` for the test, and remote workers' raw protocol clients."""

from __future__ import annotations

import hashlib
import io
import json
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from tidepool.gateway import pki
from tidepool.node.daemon import Daemon
from tidepool.settings import Settings, parse

from ..conftest import free_port

WORKERS = ("w1", "w2")


@dataclass
class Answer:
    status: int
    body: Any

    @property
    def code(self) -> str:
        return str(self.body["error"]["code"])


def client_context(lab: pki.Lab, worker: str | None) -> ssl.SSLContext:
    """A worker's TLS: it verifies the gateway by the lab's CA and presents its own certificate (None: none)."""
    context = ssl.create_default_context(cafile=str(lab.ca_file))
    if worker is not None:
        issued = lab.workers[worker]
        context.load_cert_chain(issued.cert, issued.key)
    return context


class Remote:
    """One remote worker speaking the raw /w1 protocol over one keep-alive TLS session."""

    def __init__(self, url: str, context: ssl.SSLContext) -> None:
        self.url = url
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context))
        self.streams: list[aiohttp.ClientResponse] = []  # control streams opened, released on close

    async def post(self, path: str, body: Any = None, *, data: bytes | None = None,
                   content_type: str = "application/json") -> Answer:
        raw = io.BytesIO(json.dumps(body).encode() if data is None else data)  # aiohttp warns of large bytes
        try:
            async with self.session.post(self.url + path, data=raw, headers={"Content-Type": content_type}) as r:
                return Answer(r.status, await r.json(content_type=None))
        except aiohttp.ServerDisconnectedError:
            # A revoke closes the worker's connections: a call that raced with the close is sent again on a
            # new one, as a worker does
            raw.seek(0)
            async with self.session.post(self.url + path, data=raw, headers={"Content-Type": content_type}) as r:
                return Answer(r.status, await r.json(content_type=None))

    async def acquire(self, **body: Any) -> Answer:
        return await self.post("/w1/acquire", {"types": ["noop", "sleep"], "max": 1, "wait_s": 0, **body})

    async def leased(self, **body: Any) -> dict[str, Any]:
        """The one lease an acquire must hand out."""
        answer = await self.acquire(**body)
        assert answer.status == 200, answer
        (lease,) = answer.body["tasks"]
        return dict(lease)

    async def close(self) -> None:
        for stream in self.streams:
            stream.release()
        await self.session.close()


@dataclass
class Node:
    daemon: Daemon
    lab: pki.Lab
    api: str
    w1: str
    _remotes: list[Remote] = field(default_factory=list)
    _http: aiohttp.ClientSession | None = None

    def remote(self, worker: str | None = "w1", *, context: ssl.SSLContext | None = None) -> Remote:
        remote = Remote(self.w1, context or client_context(self.lab, worker))
        self._remotes.append(remote)
        return remote

    async def call(self, method: str, path: str, body: Any = None) -> Answer:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        async with self._http.request(method, self.api + path, json=body) as r:
            return Answer(r.status, await r.json(content_type=None))

    async def submit(self, type: str = "noop", **fields: Any) -> str:
        answer = await self.call("POST", "/v1/tasks", {"type": type, **fields})
        assert answer.status == 201, answer
        return str(answer.body["id"])

    async def task(self, task_id: str) -> dict[str, Any]:
        answer = await self.call("GET", f"/v1/tasks/{task_id}")
        assert answer.status == 200, answer
        return dict(answer.body)

    async def enable(self, worker: str) -> None:
        answer = await self.call("PATCH", f"/v1/workers/{worker}", {"state": "enabled"})
        assert answer.status == 200, answer

    async def close(self) -> None:
        for remote in self._remotes:
            await remote.close()
        if self._http is not None:
            await self._http.close()


@pytest.fixture
def lab(tmp_path: Path) -> pki.Lab:
    return pki.make_lab(tmp_path / "pki", workers=WORKERS)


@pytest.fixture
def store_kind() -> str:
    """The gateway's store; a module of tests that depend on it runs them on each (parametrize store_kind)."""
    return "sqlite"


@pytest.fixture
def store_url(store_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if store_kind == "memory":
        return "memory://"
    if store_kind == "sqlite":
        return f"sqlite:///{tmp_path}/gateway.db"
    url, schema = request.getfixturevalue("postgres_schema")
    return f"{url}?schema={schema}"


def gateway_settings(tmp_path: Path, lab: pki.Lab, *, store_url: str = "memory://",
                     **sections: dict[str, Any]) -> Settings:
    """A gateway whose own pool takes none of the tasks (its types match nothing it defines)."""
    config: dict[str, Any] = {
        "node": {"id": "gw", "state_dir": str(tmp_path / "var")},
        "store": {"url": store_url},
        "api": {"listen": f"127.0.0.1:{free_port()}"},
        "pool": {"min_workers": 1, "max_workers": 1, "task_types": ["local-only"], "drain_timeout_s": 0.5},
        "guards": {"min_free_memory_mb": 0, "min_free_disk_mb": 0},
        "gateway": {"listen": f"127.0.0.1:{free_port()}", "cert_file": str(lab.gateway.cert),
                    "key_file": str(lab.gateway.key), "client_ca_file": str(lab.ca_file), "max_wait_s": 10.0},
    }
    for name, keys in sections.items():
        config.setdefault(name, {}).update(keys)
    return parse(config)


@pytest.fixture
def make_node(tmp_path: Path, lab: pki.Lab, store_url: str) -> Callable[..., Any]:
    """An async context: a gateway node running in this process until the block ends."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def running(settings: Settings | None = None, *, config_path: Path | None = None,
                      **sections: dict[str, Any]) -> AsyncIterator[Node]:
        settings = settings or gateway_settings(tmp_path, lab, store_url=store_url, **sections)
        daemon = Daemon(settings, config_path=config_path)
        node = Node(daemon, lab, f"http://{settings.api.listen}", f"https://{settings.gateway.listen}")
        async with anyio.create_task_group() as tg:
            await tg.start(daemon.run)
            try:
                yield node
            finally:
                await node.close()
                daemon.shutdown()

    return running

def lease_of(lease: dict[str, Any]) -> dict[str, str]:
    """The two fields that name a lease in a worker's renew, progress, result or finish."""
    return {"attempt_id": lease["attempt_id"], "lease_token": lease["lease_token"]}


def sha256(payload: Any) -> str:
    """A result payload's digest as its worker sends it: of the payload's canonical JSON."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=False).encode()).hexdigest()


AUTO = {"enroll": "auto"}  # [gateway] of a node that enables its workers at first contact
MakeNode = Callable[..., Any]


class ControlReader:
    """A worker's open control stream, read event by event."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def next(self, *, timeout_s: float = 5.0) -> tuple[str, dict[str, Any]] | None:
        """The next event (keep-alive comments skipped); None once the stream ended."""
        name = None
        with anyio.fail_after(timeout_s):
            async for raw in self.response.content:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: ") and name is not None:
                    return name, json.loads(line.removeprefix("data: "))
        return None


async def open_control(remote: Remote) -> ControlReader:
    response = await remote.session.get(remote.url + "/w1/control")
    remote.streams.append(response)
    assert response.status == 200, await response.text()
    return ControlReader(response)
