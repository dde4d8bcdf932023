"""The node's scan operations on a real SQLite store: a submit resolved from the config, and the events of
a move the store reports whichever call made it (here a cancel through the task API)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tidepool import settings
from tidepool.api.operations import ScanRequest
from tidepool.errors import InvalidRequest
from tidepool.events import Event, EventBus
from tidepool.execution.leases import LeaseKeeper
from tidepool.execution.resources import ResourcePool
from tidepool.execution.waker import Waker
from tidepool.metrics.exporter import Metrics
from tidepool.node.operations import ScanOperations, ScanParts
from tidepool.plugins import Registry
from tidepool.scans import ScanState
from tidepool.store.sqlite import SqliteStore

CONFIG = {"profiles": {"pair": {"steps": ["sleep", "noop"]}}, "types": {"sleep": {"plugins": ["sleep"],
                                                                                  "max_attempts": 5}}}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = SqliteStore(str(tmp_path / "tidepool.db"))
    await opened.open()
    yield opened
    await opened.close()


def scan_operations(store: SqliteStore, events: EventBus) -> ScanOperations:
    config = settings.parse(CONFIG)
    registry = Registry.from_settings(config.plugins, config.all_types, kill_grace_s=1.0)

    async def no_fleet() -> list[frozenset[str]]:
        return []

    parts = ScanParts(store, events, Waker(), LeaseKeeper(store, lease_s=30.0, renew_every_s=10.0),
                      ResourcePool({}), no_fleet)
    ops = ScanOperations(config, registry, parts)
    store.on_scan_moves(ops.moved)  # as the daemon wires it
    return ops


def told(seen: list[Event], scan_id: str) -> list[tuple[str, int | None, str | None]]:
    return [(e.name, e.data.get("index"), e.data.get("state")) for e in seen
            if e.name.startswith("scan.") and e.data["scan_id"] == scan_id]


async def test_a_submit_resolves_each_step_s_defaults_from_the_config(store: SqliteStore) -> None:
    ops = scan_operations(store, EventBus())
    scan, created = await ops.submit(ScanRequest("pair", {"seconds": 1}, priority=2))
    assert created and [j.step for j in scan.jobs] == ["sleep", "noop"]
    first = await store.get(scan.jobs[0].task_id or "")
    assert (first.type, first.max_attempts, first.priority, first.payload) == ("sleep", 5, 2, {"seconds": 1})
    with pytest.raises(InvalidRequest, match=r"^profile: unknown profile 'nope'; this node defines discover, pair"):
        await ops.submit(ScanRequest("nope", {}))


async def test_a_cancel_of_a_step_s_task_outside_the_scan_is_told_as_the_scan_s_end(store: SqliteStore) -> None:
    events = EventBus()
    seen: list[Event] = []
    events.listen(seen.append)
    # No pool: the scrape, which reads it, does not happen here.
    metrics = Metrics(node_id="n", version="0", pool=lambda: None,  # type: ignore[arg-type, return-value]
                      counts=store.counts)
    events.listen(metrics.on_event)
    ops = scan_operations(store, events)
    scan, _ = await ops.submit(ScanRequest("pair", {"seconds": 1}))

    await store.request_cancel(scan.jobs[0].task_id or "", now=time.time())  # the task API, not the scan's
    assert told(seen, scan.id) == [("scan.created", None, None), ("scan.step", 0, "queued"),
                                   ("scan.step", 0, "cancelled"), ("scan.finished", None, "cancelled")]
    assert (await store.get_scan(scan.id)).state is ScanState.CANCELLED
    assert metrics.scans_finished.values == {("pair", "cancelled"): 1}
    assert metrics.scan_steps.values == {("pair", "cancelled"): 1}

