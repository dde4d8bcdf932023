"""A gateway node in this process (the real Daemon: its /v1 API on loopback HTTP, its /w1 listener on mutual
TLS) with the certificates of a test lab, and its remote workers as raw /w1 clients (`node.remote(...)`)."""

from __future__ import annotations

import hashlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from tidepool.gateway import pki
from tidepool.model import NewTask
from tidepool.node.daemon import Daemon
from tidepool.settings import Settings, parse

from ..conftest import free_port
from ..lab import gateway_section, make_lab
from ..w1_client import Answer
from ..w1_client import Remote as Remote
from ..w1_client import client_context as client_context
from ..w1_client import open_control as open_control

WORKERS = ("w1", "w2")


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
    return make_lab(tmp_path, WORKERS)


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
        "gateway": gateway_section(lab, listen=f"127.0.0.1:{free_port()}", max_wait_s=10.0),
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

def expiring_context(lab: pki.Lab, name: str = "brief", *, left_s: float = 2.0) -> ssl.SSLContext:
    """A client context whose certificate (a day's, of `lab`'s CA) has `left_s` seconds of it left."""
    soon = datetime.now(UTC) - timedelta(days=1) + timedelta(seconds=left_s)
    issued = pki.issue(lab.dir, name, days=1, now=soon)
    context = ssl.create_default_context(cafile=str(lab.ca_file))
    context.load_cert_chain(issued.cert, issued.key)
    return context


def lease_of(lease: dict[str, Any]) -> dict[str, str]:
    """The two fields that name a lease in a worker's renew, progress, result or finish."""
    return {"attempt_id": lease["attempt_id"], "lease_token": lease["lease_token"]}


def sha_of(data: bytes) -> str:
    """A blob's name: the sha256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


async def stored(node: Node, data: bytes) -> str:
    """`data` stored as a blob of the gateway's store; its sha256."""
    async def chunks() -> AsyncIterator[bytes]:
        yield data

    blob, _ = await node.daemon.store.put_blob(chunks(), now=time.time(), max_bytes=1 << 30)
    return blob.sha256


async def with_input(node: Node, data: bytes) -> tuple[str, str]:
    """A task of the gateway's queue (type noop, one attempt) whose input `sample` is `data`: (its id, the blob's
    sha256). Submitted to the store: a submit's inputs are the API's."""
    blob = await stored(node, data)
    task, _ = await node.daemon.store.add(NewTask("noop", max_attempts=1, inputs={"sample": blob}), now=time.time())
    return task.id, blob


def sha256(payload: Any) -> str:
    """A result payload's digest as its worker sends it: of the payload's canonical JSON."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=False).encode()).hexdigest()


AUTO = {"enroll": "auto"}  # [gateway] of a node that enables its workers at first contact
MakeNode = Callable[..., Any]
