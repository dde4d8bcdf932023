"""The reconciler fails queued tasks whose tags the fleet has lacked for prepare_timeout_s, and
every task it ends is counted under its own type."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tidepool.errors import BlobNotFound, StoreUnavailable
from tidepool.events import Event, EventBus
from tidepool.execution.pool import PoolStats
from tidepool.lifecycle import RetryPolicy
from tidepool.metrics.exporter import Metrics
from tidepool.model import ClaimFilter, NewTask, State, Worker
from tidepool.node.daemon import Daemon
from tidepool.settings import parse
from tidepool.store import Node
from tidepool.store.sqlite import SqliteStore
from tidepool.upkeep.reconciler import Reconciler, ReconcilerConfig

T0 = 1_700_000_000.0
WIN = frozenset({"win10", "x64"})


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """The resource tag sets of the live nodes, as the daemon would read them; `down` when unreadable."""

    def __init__(self, *tags: frozenset[str]) -> None:
        self.tags = list(tags)
        self.down = False

    async def __call__(self) -> list[frozenset[str]]:
        if self.down:
            raise StoreUnavailable("store 127.0.0.1:5432: connection refused")
        return self.tags


class Setup:
    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self.clock = Clock()
        self.fleet = Fleet(WIN)
        self.seen: list[Event] = []
        events = EventBus()
        events.listen(self.seen.append)
        self.metrics = Metrics(node_id="node-a", version="9.9", pool=lambda: PoolStats(1, 1, 1.0, 0, 0, 0, 0, True),
                               counts=store.counts)
        events.listen(self.metrics.on_event)
        self.reconciler = Reconciler(store, events, config=ReconcilerConfig(unserviceable_after_s=60.0),
                                     policy=RetryPolicy, wake=lambda n: None, fleet_tags=self.fleet,
                                     clock=self.clock)

    async def add(self, *tags: str) -> str:
        task, _ = await self.store.add(NewTask("scan", required_tags=tags), now=self.clock.now)
        return task.id

    async def pass_at(self, at: float) -> int:
        self.clock.now = T0 + at
        return (await self.reconciler.pass_once()).unserviceable

    async def state(self, task_id: str) -> State:
        return (await self.store.get(task_id)).state


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    store = SqliteStore(tmp_path / "tidepool.db")
    await store.open()
    try:
        yield Setup(store)
    finally:
        await store.close()


async def test_a_task_whose_tags_the_fleet_lost_fails_only_after_prepare_timeout(setup: Setup) -> None:
    win, plain, x64 = await setup.add("win10"), await setup.add(), await setup.add("x64")
    assert await setup.pass_at(0) == 0
    setup.fleet.tags = [frozenset({"x64", "nic"})]  # the Windows node left the fleet
    assert await setup.pass_at(10) == 0
    assert await setup.pass_at(69) == 0
    assert await setup.state(win) is State.PENDING
    assert await setup.pass_at(70) == 1
    task = await setup.store.get(win)
    assert task.state is State.FAILED and task.error is not None and task.error.code == "unserviceable"
    assert "win10" in task.error.message
    assert [await setup.state(i) for i in (plain, x64)] == [State.PENDING, State.PENDING]
    finished = [e.data for e in setup.seen if e.name == "task.finished"]
    assert [(d["task_id"], d["state"], d["error"]["code"]) for d in finished] == [(win, "failed", "unserviceable")]
    passes = [e.data["unserviceable"] for e in setup.seen if e.name == "reconciler.pass"]
    assert passes == [0, 0, 0, 1], "every pass says so, each with its count"


async def test_tags_served_again_before_the_timeout_start_the_wait_over(setup: Setup) -> None:
    win = await setup.add("win10")
    setup.fleet.tags = []
    assert await setup.pass_at(0) == 0
    assert await setup.pass_at(50) == 0
    setup.fleet.tags = [WIN]  # the node came back
    assert await setup.pass_at(55) == 0
    setup.fleet.tags = []
    assert await setup.pass_at(100) == 0  # 40 s since it left again
    assert await setup.state(win) is State.PENDING
    assert await setup.pass_at(160) == 1


async def test_an_unreadable_fleet_view_fails_nothing(setup: Setup) -> None:
    win = await setup.add("win10")
    setup.fleet.down = True
    for at in (0, 100, 1000):
        assert await setup.pass_at(at) == 0
    assert await setup.state(win) is State.PENDING


async def test_the_wait_is_prepare_timeout_as_reloaded(setup: Setup) -> None:
    win = await setup.add("win10")
    setup.fleet.tags = []
    assert await setup.pass_at(0) == 0
    setup.reconciler.config = ReconcilerConfig(unserviceable_after_s=5.0)  # what a reload's configure() sets
    assert await setup.pass_at(5) == 1
    assert await setup.state(win) is State.FAILED


# the daemon's fleet view


async def test_the_fleet_of_a_shared_store_is_this_nodes_resources_and_every_live_nodes(tmp_path: Path) -> None:
    settings = parse({"node": {"id": "here", "state_dir": str(tmp_path)}, "store": {"url": "memory://"},
                      "resources": {"nic": {"tags": ["nic"]}}})
    daemon = Daemon(settings)
    now = time.time()

    def node(node_id: str, tags: tuple[str, ...], *, heartbeat_at: float = now,
             stopped_at: float | None = None) -> Node:
        return Node(node_id, "i", "host", 1, "0", now - 60, heartbeat_at, 2.0, ("*",), (tags,), 4, stopped_at)

    for n in (node("win", ("win10",)), node("stopped", ("gpu",), stopped_at=now),
              node("silent", ("arm",), heartbeat_at=now - 60)):
        await daemon.store.save_node(n)
    assert set(await daemon.ops.fleet_tag_sets()) == {frozenset({"nic"}), frozenset({"win10"})}


async def test_the_fleet_of_a_sqlite_store_is_this_nodes_resources(tmp_path: Path) -> None:
    settings = parse({"node": {"id": "here", "state_dir": str(tmp_path)},
                      "store": {"url": f"sqlite:///{tmp_path}/t.db"},
                      "resources": {"vm": {"tags": ["win10", "x64"], "count": 2}, "nic": {"tags": ["nic"]}}})
    assert set(await Daemon(settings).ops.fleet_tag_sets()) == {WIN, frozenset({"nic"})}


async def test_every_task_the_reconciler_ends_is_counted_under_its_type(setup: Setup) -> None:
    """Lease expiry with no attempt left, a cancel its worker never answered, unserviceable tags: each
    task.finished names the task's type, so /metrics does not file them under "unknown"."""
    store, now = setup.store, setup.clock.now
    worker = Worker("node-a", "a-1", "node-a/w1")
    await store.add(NewTask("crashy", max_attempts=1), now=now)
    await store.claim(worker, ClaimFilter(), limit=1, now=now, lease_s=30.0)  # and its node dies
    await store.add(NewTask("stubborn"), now=now)
    (stubborn,) = await store.claim(worker, ClaimFilter(), limit=1, now=now, lease_s=7200.0)  # renewed on and on
    await store.request_cancel(stubborn.task.id, now=now)
    await setup.add("gpu")  # type "scan", tags no node has
    setup.fleet.tags = []
    await setup.pass_at(0)
    await setup.pass_at(3600)  # past the leases, the cancel deadline and the unserviceable wait
    finished = sorted((e.data["type"], e.data["state"], e.data["error"]["code"])
                      for e in setup.seen if e.name == "task.finished")
    assert finished == [("crashy", "failed", "lease_expired"), ("scan", "failed", "unserviceable"),
                        ("stubborn", "cancelled", "cancel_deadline")]
    for event in (e for e in setup.seen if e.name == "task.finished"):  # the event says what the task says
        stored = (await store.get(event.data["task_id"])).error
        assert stored is not None and event.data["error"] == stored.to_json(), event
    scraped = (await setup.metrics.render()).decode()
    for line in ('tidepool_tasks_finished_total{state="failed",type="crashy"} 1.0',
                 'tidepool_tasks_finished_total{state="failed",type="scan"} 1.0',
                 'tidepool_tasks_finished_total{state="cancelled",type="stubborn"} 1.0'):
        assert line in scraped
    assert 'type="unknown"' not in scraped


async def test_every_pass_is_an_event_and_a_metric_even_when_it_found_nothing(setup: Setup) -> None:
    """Each reconciler pass emits an event and a metric: an operator alerts on a stalled reconciler, so an idle
    node's passes show too."""
    for at in (0, 5, 10):
        await setup.pass_at(at)
    assert [e.name for e in setup.seen] == ["reconciler.pass"] * 3
    scraped = (await setup.metrics.render()).decode()
    assert "tidepool_reconciler_passes_total 3.0" in scraped
    (last,) = re.findall(r"^tidepool_reconciler_last_pass_timestamp_seconds (\S+)$", scraped, re.MULTILINE)
    assert float(last) == setup.seen[-1].ts


async def test_retention_days_0_keeps_finished_tasks_for_good(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "tidepool.db")
    await store.open()
    try:
        task, _ = await store.add(NewTask("noop"), now=T0)
        await store.request_cancel(task.id, now=T0)  # finished at T0
        clock = Clock()
        keep = Reconciler(store, EventBus(), config=ReconcilerConfig(retention_days=0), policy=RetryPolicy,
                          wake=lambda n: None, clock=clock)
        clock.now = T0 + 10 * 365 * 86400
        assert (await keep.pass_once()).pruned == 0
        prune = Reconciler(store, EventBus(), config=ReconcilerConfig(retention_days=1), policy=RetryPolicy,
                           wake=lambda n: None, clock=clock)
        assert (await prune.pass_once()).pruned == 1  # and at once, on the first pass after the time
    finally:
        await store.close()


async def _one_blob(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def test_each_pass_deletes_the_blobs_no_task_named_for_keep_unreferenced_s(setup: Setup) -> None:
    setup.reconciler.config = ReconcilerConfig(keep_unreferenced_s=600.0)
    named, _ = await setup.store.put_blob(_one_blob(b"sample"), now=T0, max_bytes=100)
    orphan, _ = await setup.store.put_blob(_one_blob(b"orphan"), now=T0, max_bytes=100)
    await setup.store.add(NewTask("scan", inputs={"sample": named.sha256}), now=T0)
    setup.clock.now = T0 + 599
    assert (await setup.reconciler.pass_once()).blobs == 0
    setup.clock.now = T0 + 601
    assert (await setup.reconciler.pass_once()).blobs == 1
    assert await setup.store.get_blob(named.sha256) == named
    with pytest.raises(BlobNotFound):
        await setup.store.get_blob(orphan.sha256)
    assert [e.data["blobs"] for e in setup.seen if e.name == "reconciler.pass"] == [0, 1]
