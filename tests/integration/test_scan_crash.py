"""A node SIGKILLed in the middle of a scan: another run of the store ends it, running again only the step that
was cut off."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import anyio

from tidepool.execution.context import TaskContext
from tidepool.scans import JobState, ScanState
from tidepool.store.sqlite import SqliteStore

from .conftest import find, running_node, scan_ended

ROOT = Path(__file__).resolve().parents[2]

# The node that dies: the scan's second step signals that it runs, then waits to be killed.
DOOMED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import anyio
    from tidepool.scans import NewScan, StepSpec
    from tests.integration.conftest import find, running_node, started

    db, marker = Path(sys.argv[1]), Path(sys.argv[2])

    async def hang(ctx):
        marker.write_text(ctx.task.id)
        await anyio.sleep_forever()

    async def never(ctx):
        raise AssertionError("the third step ran on the node that was to die")

    async def main():
        from tidepool.store.sqlite import SqliteStore
        steps = (StepSpec("find"), StepSpec("probe"), StepSpec("report"))
        async with running_node(SqliteStore(db), {"find": find, "probe": hang, "report": never}, lease_s=1.0,
                                renew_every_s=0.3, work_root=db.parent) as node:
            await started(node, NewScan("web", steps, payload={"target": "h", "ports": [22, 80]}))
            await anyio.sleep_forever()

    anyio.run(main)
""")


async def test_a_scan_cut_off_by_sigkill_mid_step_ends_with_only_that_step_run_again(tmp_path: Path) -> None:
    db, marker = tmp_path / "tidepool.db", tmp_path / "probing"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    child = await anyio.open_process([sys.executable, "-c", DOOMED, str(db), str(marker)], cwd=ROOT, env=env,
                                     stdout=None, stderr=None)
    try:
        with anyio.fail_after(20):
            while not marker.exists():
                assert child.returncode is None, "the node died before its scan reached the second step"
                await anyio.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        await child.wait()
    cut_off = marker.read_text()
    seen: list[dict[str, object]] = []

    async def probe(ctx: TaskContext) -> None:
        ctx.scope["probed"] = ctx.payload["open_ports"]

    async def report(ctx: TaskContext) -> None:
        seen.append(dict(ctx.payload))

    started_at = time.time()
    async with running_node(SqliteStore(db), {"find": find, "probe": probe, "report": report},
                            work_root=tmp_path) as node:
        (scan,) = (await node.store.list_scans()).scans
        node.store.on_scan_moves(lambda moves: node.pool.wake(len(moves)))
        scan = await scan_ended(node, scan.id, timeout_s=20)  # the cut-off lease expires, its step runs again
        probe_task = await node.store.get(cut_off)
        find_task = await node.store.get(scan.jobs[0].task_id or "")
    assert scan.state is ScanState.SUCCEEDED and scan.finished_at is not None and scan.finished_at >= started_at
    assert [j.state for j in scan.jobs] == [JobState.SUCCESS] * 3
    assert [j.tasks for j in scan.jobs] == [1, 1, 1]  # no job got a second task, let alone a second success
    assert scan.jobs[1].task_id == cut_off and [a.status.value for a in probe_task.attempts] == ["expired",
                                                                                                  "succeeded"]
    assert len(find_task.attempts) == 1  # the step that had ended was not run again
    assert seen == [{"target": "h", "ports": [22, 80], "open_ports": [80], "host": "h", "probed": [80]}]
