"""Batch execution mode: one worker claims several tasks at once, runs them in turn, and keeps every lease alive."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from tidepool.context import TaskContext
from tidepool.model import AttemptStatus, State
from tidepool.pool import PoolConfig
from tidepool.store.sqlite import SqliteStore

from .conftest import Node, running_node


async def test_a_worker_runs_its_batch_in_turn_with_every_lease_renewed(sqlite_store: SqliteStore,
                                                                        tmp_path: Path) -> None:
    running = 0
    most = 0

    async def slow(ctx: TaskContext) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await anyio.sleep(0.5)
        running -= 1

    # Three runs of 0.5 s outlast the 1 s lease: the last task lives only if its lease is renewed while it waits.
    config = PoolConfig(min_workers=1, max_workers=1, claim_batch=3, poll_interval_s=0.5)
    async with running_node(sqlite_store, {"slow": slow}, pool=config, lease_s=1.0, renew_every_s=0.2,
                            work_root=tmp_path) as node:
        ids = await node.submit_many("slow", 3)
        tasks = [await node.finished(task_id) for task_id in ids]
    assert [t.state for t in tasks] == [State.COMPLETED] * 3
    assert [[a.status for a in t.attempts] for t in tasks] == [[AttemptStatus.SUCCEEDED]] * 3
    assert most == 1  # one after another
    order = [e.name for e in node.seen if e.name in ("task.leased", "plugin.started")]
    assert order == ["task.leased"] * 3 + ["plugin.started"] * 3  # one claim took all three
    assert len({e.data["worker_id"] for e in node.seen if e.name == "task.leased"}) == 1


@contextlib.asynccontextmanager
async def three_in_one_batch(store: SqliteStore, tmp_path: Path,
                             **node_options: Any) -> AsyncIterator[tuple[Node, anyio.Event, list[str]]]:
    """One worker has claimed three tasks in one batch and runs the first, which waits for the gate."""
    gate = anyio.Event()

    async def blocked(ctx: TaskContext) -> None:
        await gate.wait()

    config = PoolConfig(min_workers=1, max_workers=1, claim_batch=3, poll_interval_s=0.5)
    async with running_node(store, {"blocked": blocked}, pool=config, work_root=tmp_path, **node_options) as node:
        ids = await node.submit_many("blocked", 3)
        await node.until(lambda: "plugin.started" in node.names(ids[0]))
        yield node, gate, ids


async def test_stopping_the_pool_gives_back_the_unstarted_part_of_a_batch_at_once(sqlite_store: SqliteStore,
                                                                                 tmp_path: Path) -> None:
    async with three_in_one_batch(sqlite_store, tmp_path) as (node, gate, (first, *rest)):
        node.pool.stop_claiming()  # what the daemon's drain does on SIGTERM
        with anyio.fail_after(2):  # while the first task still runs
            while {(await node.store.get(i)).state for i in rest} != {State.PENDING}:
                await anyio.sleep(0.01)
        assert (await node.store.get(first)).state.active  # its phase is written behind: leased or running
        gate.set()
        assert (await node.finished(first)).state is State.COMPLETED
        for task_id in rest:
            task = await node.store.get(task_id)
            assert [a.status for a in task.attempts] == [AttemptStatus.INTERRUPTED]
            assert task.error is None or task.error.code == "interrupted"
        assert node.leases.held() == []


async def test_a_cancel_of_a_task_waiting_in_a_batch_ends_it_at_once_without_running_it(sqlite_store: SqliteStore,
                                                                                       tmp_path: Path) -> None:
    async with three_in_one_batch(sqlite_store, tmp_path, renew_every_s=0.05) as (node, gate, ids):
        first, waiting, last = ids
        # the cancel lands in the store only, as from another node; the next renewal notices it
        assert (await node.store.request_cancel(waiting, now=time.time())).state is State.CANCELLING
        with anyio.fail_after(2):  # not at its turn, nor at the reconciler's cancel deadline (5 s here)
            cancelled = await node.finished(waiting)
        assert not gate.is_set() and "plugin.finished" not in node.names(first)
        gate.set()
        assert [(await node.finished(i)).state for i in (first, last)] == [State.COMPLETED] * 2
    assert cancelled.state is State.CANCELLED
    assert [a.status for a in cancelled.attempts] == [AttemptStatus.CANCELLED]
    assert node.names(waiting) == ["task.leased", "task.finished"]  # it never started: no phases
