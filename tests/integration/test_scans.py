"""Scans on a running node: each step's plugins run in a task of their own, handed what the steps before learned."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from tidepool.errors import PluginError
from tidepool.execution.context import TaskContext
from tidepool.scans import NewScan, ScanState, StepSpec
from tidepool.store.sqlite import SqliteStore

from .conftest import find, running_node, scan_ended, started


async def test_a_second_steps_plugin_reads_what_the_first_steps_plugin_put_in_its_scope(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    async def probe(ctx: TaskContext) -> None:
        seen.append(dict(ctx.payload))
        ctx.scope["web"] = {str(p): "http" for p in ctx.payload["open_ports"]}
        await ctx.emit({"probed": ctx.payload["open_ports"]}, final=True)

    steps = (StepSpec("find"), StepSpec("probe"))
    async with running_node(sqlite_store, {"find": find, "probe": probe}, work_root=tmp_path) as node:
        scan_id = await started(node, NewScan("web", steps, payload={"target": "10.0.0.7", "ports": [22, 8080]}))
        scan = await scan_ended(node, scan_id)
        probe_task = await node.store.get(scan.jobs[1].task_id or "")
    assert scan.state is ScanState.SUCCEEDED
    assert seen == [{"target": "10.0.0.7", "ports": [22, 8080], "open_ports": [8080], "host": "10.0.0.7"}]
    assert scan.scope == {"open_ports": [8080], "host": "10.0.0.7", "web": {"8080": "http"}}
    assert [r.payload for r in probe_task.results] == [{"probed": [8080]}]


async def test_a_retried_step_starts_from_the_scope_before_it(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    runs: list[dict[str, Any]] = []

    async def flaky(ctx: TaskContext) -> None:
        runs.append(dict(ctx.payload))
        ctx.scope["half_done"] = True  # learned by a step that then fails: not kept
        ctx.scope["open_ports"] = []
        if len(runs) == 1:
            raise PluginError("the probe broke", code="probe_broke", retryable=False)

    steps = (StepSpec("find"), StepSpec("flaky"))
    async with running_node(sqlite_store, {"find": find, "flaky": flaky}, work_root=tmp_path) as node:
        scan_id = await started(node, NewScan("web", steps, payload={"target": "h", "ports": [443]}))
        failed = await scan_ended(node, scan_id)
        assert failed.state is ScanState.FAILED and failed.jobs[1].error is not None
        assert failed.jobs[1].error.code == "probe_broke"
        await node.store.retry_job(scan_id, 1, now=time.time())
        node.pool.wake(1)
        scan = await scan_ended(node, scan_id)
    assert scan.state is ScanState.SUCCEEDED
    assert runs == [{"target": "h", "ports": [443], "open_ports": [443], "host": "h"}] * 2
    assert scan.scope == {"open_ports": [], "host": "h", "half_done": True}


async def test_the_reconcilers_pass_moves_on_a_scan_left_between_steps(sqlite_store: SqliteStore,
                                                                       tmp_path: Path) -> None:
    """A step task ended with its scan left behind (as a crash between two writes would leave it): the next
    pass starts the next step, and says so in its report."""
    reports: list[int] = []
    async with running_node(sqlite_store, {"find": find}, work_root=tmp_path) as node:
        node.events.listen(lambda e: reports.append(e.data["scans"]) if e.name == "reconciler.pass" else None)
        steps = (StepSpec("later", required_tags=("gpu",)), StepSpec("find"))
        scan, _ = await node.store.add_scan(NewScan("two", steps, payload={"target": "h", "ports": [1]}),
                                            now=time.time())
        with sqlite3.connect(sqlite_store.path) as conn:  # no resource here runs the first step: ended by hand
            conn.execute("UPDATE tasks SET state = 'completed', finished_at = ? WHERE id = ?",
                         (time.time(), scan.jobs[0].task_id))
        node.store.on_scan_moves(lambda moves: node.pool.wake(len(moves)))
        ended = await scan_ended(node, scan.id)
    assert ended.state is ScanState.SUCCEEDED and ended.scope == {"open_ports": [1], "host": "h"}
    assert 1 in reports
