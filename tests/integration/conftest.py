"""An in-process node (store, leases, engine, pool, reconciler) with plugins the test defines.

Optional parts come in as keyword arguments: a ready Registry (e.g. from Registry.from_settings),
a ResourcePool (its free slots then shape the claim filter, as in the daemon) and Guards (asked
before every claim, run in the node's task group, waking the pool when they clear). `registry_of`
builds a Registry from plugin specs the way the daemon builds its own from the config. A scan is
`started` on a node and waited for with `scan_ended`; `find` is a first step that learns open ports.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from tidepool.events import Event, EventBus
from tidepool.execution.context import TaskContext
from tidepool.execution.engine import Engine, EngineConfig
from tidepool.execution.guards import Guards
from tidepool.execution.leases import LeaseKeeper
from tidepool.execution.pool import Pool, PoolConfig
from tidepool.execution.resources import ResourcePool
from tidepool.execution.waker import Waker
from tidepool.lifecycle import RetryPolicy
from tidepool.model import ClaimFilter, NewTask, State, Task
from tidepool.plugins import Plugin, PluginDef, Registry
from tidepool.scans import NewScan, Scan
from tidepool.settings import PluginSpec, PluginsSettings, TypeSettings
from tidepool.store import Store
from tidepool.store.sqlite import SqliteStore
from tidepool.upkeep.reconciler import Reconciler, ReconcilerConfig

GRACE_S = 0.5  # a command's kill grace (SIGTERM to SIGKILL) in the registries registry_of builds


def registry_of(defs: dict[str, PluginSpec], types: dict[str, TypeSettings] | None = None,
                **access: tuple[str, ...]) -> Registry:
    """The daemon's registry of these plugins; without `types`, one type per plugin, named after it.
    `access` is plugins.allow / plugins.deny."""
    if types is None:
        types = {name: TypeSettings(plugins=(name,)) for name in defs}
    return Registry.from_settings(PluginsSettings(defs=defs, **access), types, kill_grace_s=GRACE_S)


@dataclass
class Node:
    store: Store
    events: EventBus
    leases: LeaseKeeper
    engine: Engine
    pool: Pool
    reconciler: Reconciler
    seen: list[Event] = field(default_factory=list)

    async def submit(self, type: str, payload: dict[str, Any] | None = None, **kw: Any) -> str:
        task, _ = await self.store.add(NewTask(type, payload or {}, **kw), now=time.time())
        self.pool.wake(1)
        return task.id

    async def submit_many(self, type: str, n: int, payload: dict[str, Any] | None = None) -> list[str]:
        added = await self.store.add_many([NewTask(type, payload or {}) for _ in range(n)], now=time.time())
        ids = [task_id for task_id, _ in added]
        self.pool.wake(n)
        return ids

    async def until(self, condition: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
        with anyio.fail_after(timeout_s):
            while not condition():
                await anyio.sleep(0.005)

    async def finished(self, task_id: str, *, timeout_s: float = 10.0) -> Task:
        with anyio.fail_after(timeout_s):
            while not (task := await self.store.get(task_id)).state.terminal:
                await anyio.sleep(0.01)
        return task

    def names(self, task_id: str) -> list[str]:
        return [e.name + (f":{e.data['phase']}" if e.name == "task.phase" else "")
                for e in self.seen if e.data.get("task_id") == task_id]


@asynccontextmanager
async def running_node(store: Store, plugins: dict[str, Plugin], *, types: dict[str, TypeSettings] | None = None,
                       pool: PoolConfig | None = None, lease_s: float = 30.0, renew_every_s: float = 10.0,
                       policy: RetryPolicy | None = None, work_root: Path, registry: Registry | None = None,
                       resources: ResourcePool | None = None, guards: Guards | None = None,
                       engine_config: EngineConfig | None = None, events: EventBus | None = None,
                       waker: Waker | None = None) -> AsyncIterator[Node]:
    if registry is None:
        types = types or {name: TypeSettings(plugins=(name,)) for name in plugins}
        registry = Registry({n: PluginDef(n, fn) for n, fn in plugins.items()}, types)
    events = events or EventBus()
    leases = LeaseKeeper(store, lease_s=lease_s, renew_every_s=renew_every_s, flush_every_s=0.02)
    engine = Engine(store, registry, leases, events, config=engine_config or EngineConfig(stop_timeout_s=2.0),
                    policy=policy or RetryPolicy(base_s=0.0, jitter=0.0), work_root=work_root,
                    resources=resources)
    claim_filter: Callable[[], ClaimFilter] = ClaimFilter
    extra: dict[str, Any] = {}
    if resources is not None:
        slots = resources

        def claim_filter() -> ClaimFilter:
            return ClaimFilter(tag_sets=slots.free_tag_sets())

        extra["promise_slots"] = slots.claiming  # as the daemon wires it
    the_pool = Pool(store, engine, leases, events, config=pool or PoolConfig(poll_interval_s=0.5),
                    node_id="test-node", instance_id="i1", claim_filter=claim_filter,
                    may_claim=guards.ok if guards is not None else lambda: True, waker=waker, **extra)
    if resources is not None:
        resources.on_free = lambda: the_pool.wake(1)
    if guards is not None:
        guards.on_clear = lambda: the_pool.wake(the_pool.config.max_workers)
    reconciler = Reconciler(store, events, config=ReconcilerConfig(interval_s=0.05, cancel_deadline_s=5.0),
                            policy=lambda: engine.policy, wake=the_pool.wake)
    node = Node(store, events, leases, engine, the_pool, reconciler)
    events.listen(node.seen.append)
    await store.open()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(leases.run)
            if guards is not None:
                await tg.start(guards.run)
            await tg.start(the_pool.run)
            await tg.start(reconciler.run)
            yield node
            tg.cancel_scope.cancel()
    finally:
        await store.close()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> SqliteStore:
    return SqliteStore(tmp_path / "tidepool.db")


@pytest.fixture
async def store(sqlite_store: SqliteStore) -> AsyncIterator[SqliteStore]:
    """The SQLite store, opened, for a test that drives a part alone (running_node opens its own)."""
    await sqlite_store.open()
    yield sqlite_store
    await sqlite_store.close()


def done_states(*states: State) -> set[str]:
    return {s.value for s in states}


# scans on the node


async def scan_ended(node: Node, scan_id: str, *, timeout_s: float = 10.0) -> Scan:
    with anyio.fail_after(timeout_s):
        while not (scan := await node.store.get_scan(scan_id)).state.ended:
            await anyio.sleep(0.01)
    return scan


async def started(node: Node, new: NewScan) -> str:
    node.store.on_scan_moves(lambda moves: node.pool.wake(len(moves)))  # as the daemon wires it
    scan, _ = await node.store.add_scan(new, now=time.time())
    node.pool.wake(1)
    return scan.id


async def find(ctx: TaskContext) -> None:
    """A scan's first step: learns its target's open ports (all it was given but 22) for the steps after it."""
    ctx.scope["open_ports"] = [p for p in ctx.payload["ports"] if p != 22]
    ctx.scope["host"] = ctx.payload["target"]
