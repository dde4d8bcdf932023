"""A fleet on PostgreSQL: daemons as subprocesses sharing one schema of the test server, with plugins that
record each run in a file, and the store read behind their backs."""

from __future__ import annotations

import asyncio
import itertools
import textwrap
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..conftest import POSTGRES_URL

if TYPE_CHECKING:
    from .conftest import Daemon

PLUGINS = '''
"""Test plugins: each appends what it did to a file, so the test can count executions."""
import os

import anyio

from tidepool.errors import LeaseLost, StoreUnavailable


def _append(path, line):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\\n").encode())
    finally:
        os.close(fd)


async def append(ctx):
    await anyio.sleep(ctx.payload.get("seconds", 0))
    _append(ctx.payload["file"], ctx.task.id)


async def insist(ctx):
    """Sleeps, then records its result, both shielded from the attempt's cancellation: a plugin that keeps
    working after its lease is gone and insists on writing, until the store answers (at most 30 s)."""
    with anyio.CancelScope(shield=True):
        await anyio.sleep(ctx.payload.get("seconds", 0))
        _append(ctx.payload["file"], ctx.task.id)
        deadline = anyio.current_time() + 30
        while True:
            try:
                await ctx.emit({"attempt": ctx.attempt_id}, final=True)
                return
            except LeaseLost:
                _append(ctx.payload["rejected"], f"{ctx.task.id} {ctx.attempt_id}")
                raise
            except StoreUnavailable:
                if anyio.current_time() > deadline:
                    raise
                await anyio.sleep(0.2)
'''


class Fleet:
    """Daemons on one schema; `q` reads the store directly."""

    def __init__(self, root: Path, make_daemon: Callable[..., Daemon], schema: str) -> None:
        self.root = root
        self.schema = schema
        self.url = f"{POSTGRES_URL}?schema={schema}"
        self._make = make_daemon
        self.plugins = root / "plugins"
        self.plugins.mkdir()
        (self.plugins / "cluster_plugins.py").write_text(textwrap.dedent(PLUGINS))
        self.done_file = root / "done.txt"
        self.rejected_file = root / "rejected.txt"
        self.daemons: dict[str, Daemon] = {}

    def config(self, node_id: str, *, url: str | None = None, **sections: dict[str, Any]) -> dict[str, Any]:
        config: dict[str, dict[str, Any]] = {
            "node": {"id": node_id},
            "store": {"url": url or self.url},
            "pool": {"min_workers": 4, "max_workers": 4, "poll_interval_s": 1.0, "drain_timeout_s": 1.0},
            "lease": {"duration_s": 3.0, "renew_every_s": 1.0},
            "reconciler": {"interval_s": 0.5},
            "retry": {"backoff_base_s": 0.1, "backoff_max_s": 0.2, "max_attempts": 5},
            "plugins.append": {"python": "cluster_plugins:append"},
            "plugins.insist": {"python": "cluster_plugins:insist"},
            "types.append": {"plugins": ["append"]},
            "types.insist": {"plugins": ["insist"]},
            "log": {"level": "info"},
        }
        for section, keys in sections.items():
            config.setdefault(section, {}).update(keys)
        return config

    def add(self, node_id: str, *, url: str | None = None, **sections: dict[str, Any]) -> Daemon:
        root = self.root / node_id
        root.mkdir(exist_ok=True)
        daemon = self._make(self.config(node_id, url=url, **sections), root=root,
                            env={"PYTHONPATH": str(self.plugins)})
        self.daemons[node_id] = daemon
        return daemon

    def start(self, *daemons: Daemon) -> None:
        """Start together; each is ready (/readyz 200) on return."""
        with ThreadPoolExecutor(len(daemons)) as pool:
            for future in [pool.submit(d.start) for d in daemons]:
                future.result()

    def q(self, sql: str, *args: Any) -> list[Any]:
        async def fetch() -> list[Any]:
            import asyncpg

            conn = await asyncpg.connect(POSTGRES_URL, server_settings={"search_path": f'"{self.schema}"'})
            try:
                return [tuple(r) for r in await conn.fetch(sql, *args)]
            finally:
                await conn.close()

        return asyncio.run(fetch())

    def submit(self, type_: str, n: int, *, via: Sequence[Daemon], **payload: Any) -> list[str]:
        """n tasks in batches of 50, round robin over the daemons' APIs (so wake-ups cross nodes)."""
        payload = {"file": str(self.done_file), "rejected": str(self.rejected_file), **payload}
        ids: list[str] = []
        for k, start in enumerate(range(0, n, 50)):
            body = {"tasks": [{"type": type_, "payload": payload}] * min(50, n - start)}
            r = via[k % len(via)].post("/v1/tasks/batch", body)
            assert r.status == 201, r
            ids += r.body["ids"]
        return ids

    def wait(self, what: str, check: Callable[[], Any], *, timeout_s: float = 30.0, poll_s: float = 0.1) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            result = check()
            if result:
                return result
            if time.monotonic() >= deadline:
                logs = "\n".join(f"--- {name}\n{d.log(15)}" for name, d in self.daemons.items())
                pytest.fail(f"timed out after {timeout_s}s waiting for {what}; last: {result!r}\n{logs}")
            time.sleep(poll_s)

    def completed(self, ids: Sequence[str]) -> bool:
        (n,), = self.q("SELECT count(*) FROM tasks WHERE id = ANY($1::text[]) AND state = 'completed'", list(ids))
        return bool(n == len(ids))

    def live_attempts(self, node_id: str, statuses: tuple[str, ...] = ("leased", "running")) -> list[tuple[str, str]]:
        rows = self.q("SELECT task_id, id FROM attempts WHERE node_id = $1 AND status = ANY($2::text[])",
                      node_id, list(statuses))
        return [(r[0], r[1]) for r in rows]

    def lines(self, path: Path) -> list[str]:
        return path.read_text().split() if path.exists() else []

    def assert_no_overlapping_attempts(self) -> None:
        """No moment with two live leases on one task: each attempt ended before the next began."""
        rows = self.q("SELECT task_id, id, started_at, finished_at, status FROM attempts ORDER BY task_id, started_at")
        by_task: dict[str, list[Any]] = {}
        for row in rows:
            by_task.setdefault(row[0], []).append(row)
        for task_id, attempts in by_task.items():
            for earlier, later in itertools.pairwise(attempts):
                assert earlier[3] is not None, f"task {task_id}: attempt {earlier[1]} never ended, yet {later[1]} ran"
                assert earlier[3] <= later[2], f"task {task_id}: attempts {earlier[1]} and {later[1]} overlap"

    def nodes(self, via: Daemon) -> dict[str, bool]:
        r = via.get("/v1/nodes")
        assert r.status == 200, r
        return {n["node_id"]: n["alive"] for n in r.body["nodes"]}
