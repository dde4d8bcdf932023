"""A whole node run in the test's process, for the tests of files through its API: its real store, operations
and app, on a port of its own. Its pool claims no type, so a test leases a task itself (`leased`) and records
its artifacts as a worker would."""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio

from tidepool.model import Claimed, ClaimFilter, Phase, Worker
from tidepool.node.daemon import Daemon
from tidepool.settings import Settings
from tidepool.store import PhaseNote
from tidepool.store.port import ArtifactQuota

from .conftest import free_port

STORE_URLS = ["memory://", "sqlite:///{state_dir}/tidepool.db"]  # PostgreSQL joins once it learns blobs
QUOTA = ArtifactQuota(max_count=100, max_bytes=1 << 30, max_blob_bytes=1 << 30)
MAX_BLOB = 1 << 20
WORKER = Worker("files-test", "i-1", "w-1")
DATA = bytes(range(256)) * 5000  # 1.28 MB: more than one of the store's chunks


NodeAt = Callable[[], AbstractAsyncContextManager["Node"]]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Node:
    daemon: Daemon
    http: aiohttp.ClientSession
    url: str

    async def call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any, aiohttp.ClientResponse]:
        async with self.http.request(method, self.url + path, **kwargs) as r:
            raw = await r.read()
            body = await r.json() if r.content_type == "application/json" else raw
            return r.status, body, r

    async def upload(self, data: bytes, **headers: str) -> tuple[int, Any]:
        status, body, _ = await self.call("POST", "/v1/blobs", data=io.BytesIO(data),
                                          headers={"Content-Type": "application/octet-stream", **headers})
        return status, body

    async def leased(self, **fields: Any) -> Claimed:
        """A task of type noop, submitted through the API and leased here as a worker would."""
        status, task, _ = await self.call("POST", "/v1/tasks", json={"type": "noop", **fields})
        assert status == 201, task
        claimed = await self.lease()
        assert claimed.task.id == task["id"]
        return claimed

    async def lease(self) -> Claimed:
        """The oldest noop task, leased and running, as a worker's would be."""
        store = self.daemon.store
        [claimed] = await store.claim(WORKER, ClaimFilter(("noop",)), limit=1, now=time.time(), lease_s=30.0)
        await store.set_phase([PhaseNote(claimed.lease, Phase.RUN)], now=time.time())
        return claimed

    async def artifact(self, claimed: Claimed, name: str, data: bytes, content_type: str | None = None) -> None:
        await self.daemon.store.record_artifact(claimed.lease, name, data, content_type=content_type,
                                                now=time.time(), quota=QUOTA)


@asynccontextmanager
async def running(tmp_path: Path, store_url: str, *, token: str | None = None) -> AsyncIterator[Node]:
    """The node, in the test's own task (a task group cannot span a fixture's setup and teardown); with `token`,
    its /v1 routes need it (the node's client here sends it)."""
    port = free_port()
    api: dict[str, Any] = {"listen": f"127.0.0.1:{port}"}
    if token is not None:
        (tmp_path / "api.token").write_text(token)
        (tmp_path / "api.token").chmod(0o600)
        api["token_file"] = str(tmp_path / "api.token")
    state_dir = tmp_path / "var"
    settings = Settings(node={"id": "files-node", "state_dir": str(state_dir)},
                        store={"url": store_url.format(state_dir=state_dir)}, api=api,
                        pool={"task_types": ["claims-nothing"], "drain_timeout_s": 1.0},
                        guards={"min_free_memory_mb": 0, "min_free_disk_mb": 0},
                        artifacts={"max_blob_bytes": MAX_BLOB * 2}, profiles={"twice": {"steps": ["noop", "noop"]}})
    daemon = Daemon(settings)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with anyio.create_task_group() as tg, aiohttp.ClientSession(headers=headers) as http:
        await tg.start(daemon.run)
        try:
            yield Node(daemon, http, f"http://127.0.0.1:{port}")
        finally:
            daemon.shutdown()
