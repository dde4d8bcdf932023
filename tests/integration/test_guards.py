"""Host guards: below a free-memory or free-disk floor the node claims nothing; when it recovers, work resumes."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import psutil  # type: ignore[import-untyped]
import pytest

from tidepool import cli
from tidepool.api.node import PoolOut
from tidepool.events import EventBus
from tidepool.execution.context import TaskContext
from tidepool.execution.guards import MB, Guards
from tidepool.execution.pool import PoolConfig
from tidepool.model import State
from tidepool.node.daemon import Daemon
from tidepool.settings import GuardSettings, parse
from tidepool.store.sqlite import SqliteStore

from ..conftest import free_port
from .conftest import running_node


async def noop(ctx: TaskContext) -> None:
    pass


def names(events: EventBus) -> list[tuple[str, str]]:
    return [(e.name, e.data["guard"]) for e in events.since(0) if e.name.startswith("guard.")]


async def test_with_floors_above_what_is_free_nothing_is_claimed_until_they_are_lowered(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    free_memory_mb = psutil.virtual_memory().available // MB
    free_disk_mb = psutil.disk_usage(str(tmp_path)).free // MB
    events = EventBus()
    guards = Guards(events, state_dir=tmp_path / "state", min_free_memory_mb=free_memory_mb * 4,
                    min_free_disk_mb=free_disk_mb * 4)  # the real probes, with floors no host can meet
    config = PoolConfig(min_workers=2, max_workers=4, poll_interval_s=0.05)  # workers keep asking
    async with running_node(sqlite_store, {"noop": noop}, pool=config, guards=guards, events=events,
                            work_root=tmp_path) as node:
        assert guards.statistics().tripped == ("memory", "disk")
        ids = await node.submit_many("noop", 3)
        await anyio.sleep(1.0)  # twenty polls' worth of chances to claim
        assert [(await node.store.get(i)).state for i in ids] == [State.PENDING] * 3
        assert not [e for e in node.seen if e.name == "task.leased"]
        assert not node.pool.statistics().claiming, "GET /v1/pool and the metric say so"

        guards.configure(GuardSettings(min_free_memory_mb=0, min_free_disk_mb=0))
        for task_id in ids:
            assert (await node.finished(task_id, timeout_s=5)).state is State.COMPLETED
        assert node.pool.statistics().claiming
    assert names(events) == [("guard.tripped", "memory"), ("guard.tripped", "disk"),
                             ("guard.cleared", "memory"), ("guard.cleared", "disk")]
    tripped = next(e for e in events.since(0) if e.name == "guard.tripped")
    assert tripped.data["min_free_mb"] == free_memory_mb * 4
    assert 0 < tripped.data["free_mb"] < tripped.data["min_free_mb"]


async def test_recovery_wakes_the_pool_at_once(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    free = {"disk": 100 * MB}
    events = EventBus()
    guards = Guards(events, state_dir=tmp_path, min_free_memory_mb=0, min_free_disk_mb=512,
                    disk_probe=lambda path: free["disk"], interval_s=3600)
    # A one-minute poll: the task can only be claimed this fast if clearing the guard wakes the pool.
    config = PoolConfig(min_workers=1, max_workers=2, poll_interval_s=60.0)
    async with running_node(sqlite_store, {"noop": noop}, pool=config, guards=guards, events=events,
                            work_root=tmp_path) as node:
        task_id = await node.submit("noop")
        await anyio.sleep(0.2)
        assert (await node.store.get(task_id)).state is State.PENDING
        assert guards.statistics().free_disk_mb == 100
        free["disk"] = 600 * MB
        guards.check()  # what the run loop does every interval_s
        assert (await node.finished(task_id, timeout_s=2)).state is State.COMPLETED
    assert names(events) == [("guard.tripped", "disk"), ("guard.cleared", "disk")]


def test_a_failing_probe_keeps_the_guard_as_it_was(tmp_path: Path) -> None:
    readings: list[int | Exception] = [100 * MB, OSError("statvfs failed"), 900 * MB]

    def probe(path: Path) -> int:
        reading = readings.pop(0)
        if isinstance(reading, Exception):
            raise reading
        return reading

    guards = Guards(EventBus(), state_dir=tmp_path, min_free_memory_mb=0, min_free_disk_mb=512,
                    disk_probe=probe)
    guards.check()
    assert not guards.ok()
    guards.check()
    assert not guards.ok() and guards.statistics().free_disk_mb == 100
    guards.check()
    assert guards.ok()


def test_a_state_dir_not_made_yet_is_measured_on_its_file_system(tmp_path: Path) -> None:
    guards = Guards(EventBus(), state_dir=tmp_path / "not" / "yet", min_free_memory_mb=1, min_free_disk_mb=1)
    guards.check()
    assert guards.ok()
    stats = guards.statistics()
    assert stats.free_disk_mb is not None and stats.free_disk_mb > 0
    assert stats.free_memory_mb is not None and stats.free_memory_mb > 0


async def test_the_pool_view_and_tidepool_pool_show_guards_and_resources(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    settings = parse({
        "node": {"id": "guarded", "state_dir": str(tmp_path / "var")},
        "store": {"url": f"sqlite:///{tmp_path}/var/tidepool.db"},
        "api": {"listen": f"127.0.0.1:{port}"},
        "guards": {"min_free_memory_mb": 10**9, "min_free_disk_mb": 0},
        "resources": {"vm": {"tags": ["win10"], "count": 2}},
    })
    daemon = Daemon(settings)
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        view = PoolOut.of(await daemon.ops.pool_view(), gateway=False).to_json()
        # the CLI runs its own event loop: give it a thread, as a separate process would have
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(cli.main(["pool", "--url", f"http://127.0.0.1:{port}"])))
        thread.start()
        while thread.is_alive():
            await anyio.sleep(0.01)
        daemon.shutdown()
    assert view["guards"]["tripped"] == ["memory"]
    assert view["guards"]["min_free_memory_mb"] == 10**9 and view["guards"]["free_memory_mb"] > 0
    assert view["guards"]["free_disk_mb"] > 0 and view["guards"]["min_free_disk_mb"] == 0
    assert view["resources"] == {"vm": {"in_use": 0, "count": 2, "tags": ["win10"]}}
    assert result == [0]
    out = capsys.readouterr().out
    assert "guards   tripped: memory;" in out and "(floor 1000000000)" in out
    assert "resource vm: 0/2 in use, tags win10" in out
