"""Claims that fill idle workers: one claim leases a task for every worker free to start one, never more."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio

from tidepool.execution.context import TaskContext
from tidepool.execution.pool import PoolConfig
from tidepool.model import AttemptStatus, Claimed, ClaimFilter, NewTask, State, Worker
from tidepool.node.gateway import WakerWithGateway
from tidepool.store.sqlite import SqliteStore

from .conftest import Node, running_node


class RecordingStore(SqliteStore):
    """The SQLite store, recording each claim's limit and how many tasks it leased."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.claims: list[tuple[int, int]] = []

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        claimed = await super().claim(worker, where, limit=limit, now=now, lease_s=lease_s)
        self.claims.append((limit, len(claimed)))
        return claimed


def leased_in_store(path: Path) -> tuple[int, int]:
    """(attempts opened, tasks still pending), read from the SQLite file itself."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        (attempts,), = conn.execute("SELECT count(*) FROM attempts").fetchall()
        (pending,), = conn.execute("SELECT count(*) FROM tasks WHERE state = 'pending'").fetchall()
    return attempts, pending


def gated() -> tuple[anyio.Event, dict[str, Any]]:
    gate = anyio.Event()

    async def blocked(ctx: TaskContext) -> None:
        await gate.wait()

    return gate, {"blocked": blocked}


async def running(node: Node, n: int) -> None:
    await node.until(lambda: sum(e.name == "plugin.started" for e in node.seen) >= n)


async def test_one_claim_leases_a_task_for_each_idle_worker_and_no_more(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path / "tidepool.db")
    gate, plugins = gated()
    config = PoolConfig(min_workers=4, max_workers=4, claim_batch=32, poll_interval_s=30.0)
    async with running_node(store, plugins, pool=config, work_root=tmp_path) as node:
        await node.until(lambda: len(store.claims) == 1)  # the start's: the first worker claimed for all four
        assert store.claims == [(4, 0)]
        store.claims.clear()
        ids = await node.submit_many("blocked", 10)  # wakes every sleeping worker
        await running(node, 4)
        assert leased_in_store(store.path) == (4, 6)  # four attempts for four workers; six left queued
        assert store.claims == [(4, 4)], "one claim served the four idle workers"
        leased = [e for e in node.seen if e.name == "task.leased"]
        assert len({e.data["worker_id"] for e in leased}) == 4, "each worker runs one of them"
        gate.set()
        tasks = [await node.finished(task_id) for task_id in ids]
    assert [t.state for t in tasks] == [State.COMPLETED] * 10
    assert [[a.status for a in t.attempts] for t in tasks] == [[AttemptStatus.SUCCEEDED]] * 10
    assert all(limit <= 4 and got <= limit for limit, got in store.claims)


async def test_a_claim_leases_only_for_the_workers_free_now_and_at_most_claim_batch(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path / "tidepool.db")
    gate, plugins = gated()
    config = PoolConfig(min_workers=6, max_workers=6, claim_batch=3, poll_interval_s=30.0)
    async with running_node(store, plugins, pool=config, work_root=tmp_path) as node:
        await node.until(lambda: sum(limit for limit, _ in store.claims) == 6)  # the start's: two claims of 3
        await node.submit_many("blocked", 2)
        await running(node, 2)
        assert leased_in_store(store.path) == (2, 0)
        store.claims.clear()
        await node.submit_many("blocked", 10)  # four workers are free now: four more leases, in claims of 3 at most
        await running(node, 6)
        assert leased_in_store(store.path) == (6, 6)
        assert sum(got for _, got in store.claims) == 4
        assert all(limit <= 3 for limit, _ in store.claims), store.claims
        assert node.pool.statistics().busy == 6
        gate.set()


async def test_stopping_the_pool_gives_back_a_parked_task_at_once(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "tidepool.db")
    gate, plugins = gated()
    config = PoolConfig(min_workers=1, max_workers=1, poll_interval_s=30.0)
    async with running_node(store, plugins, pool=config, work_root=tmp_path) as node:
        (task_id,) = await node.submit_many("blocked", 1)
        await running(node, 1)
        (parked_id,) = await park_one(node, "blocked")
        node.pool.stop_claiming()  # what the daemon's drain does on SIGTERM
        with anyio.fail_after(2):  # while the running task still runs
            while (parked := await node.store.get(parked_id)).state is not State.PENDING:
                await anyio.sleep(0.01)
        assert parked.attempt == 0, "given back, its attempt not charged"
        assert [a.status for a in parked.attempts] == [AttemptStatus.INTERRUPTED]
        gate.set()
        assert (await node.finished(task_id)).state is State.COMPLETED
    assert node.leases.held() == []


async def test_a_cancel_of_a_parked_task_ends_it_at_once_without_running_it(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "tidepool.db")
    gate, plugins = gated()
    config = PoolConfig(min_workers=1, max_workers=1, poll_interval_s=30.0)
    async with running_node(store, plugins, pool=config, work_root=tmp_path, renew_every_s=0.05) as node:
        await node.submit_many("blocked", 1)
        await running(node, 1)
        (parked_id,) = await park_one(node, "blocked")
        # the cancel lands in the store only, as from another node; the next renewal notices it
        assert (await node.store.request_cancel(parked_id, now=time.time())).state is State.CANCELLING
        with anyio.fail_after(2):  # not once a worker is free, nor at the reconciler's cancel deadline (5 s)
            cancelled = await node.finished(parked_id)
        assert not gate.is_set()
        gate.set()
    assert cancelled.state is State.CANCELLED
    assert [a.status for a in cancelled.attempts] == [AttemptStatus.CANCELLED]
    assert "plugin.started" not in node.names(parked_id)  # it never started


async def park_one(node: Node, task_type: str) -> list[str]:
    """A task leased and parked for a worker, as a claim for several idle workers parks its others, while
    the pool's only worker is busy: it waits there until that worker is free."""
    (task_id,) = await node.submit_many(task_type, 1)
    worker = Worker("test-node", "i1", "test-node/w1")
    (claimed,) = await node.store.claim(worker, ClaimFilter(), limit=1, now=time.time(), lease_s=30.0)
    node.pool.handoff.put(claimed, worker.worker_id)
    return [task_id]


async def test_work_that_arrives_while_one_claim_serves_every_worker_is_started_at_once(tmp_path: Path) -> None:
    """The one claim made for four idle workers looked at the queue before the task went in, and comes back
    empty: the wake that came meanwhile must send a worker to claim again, not be spent on a worker that
    claim had counted in (a missed wake costs the 30 s poll here)."""
    looked, answer = anyio.Event(), anyio.Event()

    class LateAnswer(RecordingStore):  # the real store; its first claim holds its (empty) answer back
        async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                        lease_s: float) -> list[Claimed]:
            claimed = await super().claim(worker, where, limit=limit, now=now, lease_s=lease_s)
            if len(self.claims) == 1:
                looked.set()
                await answer.wait()
            return claimed

    store = LateAnswer(tmp_path / "tidepool.db")
    gate, plugins = gated()
    config = PoolConfig(min_workers=4, max_workers=4, poll_interval_s=30.0)
    async with running_node(store, plugins, pool=config, work_root=tmp_path) as node:
        with anyio.fail_after(5):
            await looked.wait()
        assert store.claims == [(4, 0)], "one claim out, for all four workers"
        await node.submit_many("blocked", 1)  # adds and wakes one while that claim is out
        answer.set()
        with anyio.fail_after(5):
            await node.until(lambda: node.pool.statistics().busy == 1)
        gate.set()


class HeldClaim(RecordingStore):
    """The real store; its first claim waits, before it looks at the queue, until `go` is set."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.out, self.go = anyio.Event(), anyio.Event()

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        if not self.out.is_set():
            self.out.set()
            await self.go.wait()
            now = time.time()  # it looks now: at what was submitted meanwhile too
        return await super().claim(worker, where, limit=limit, now=now, lease_s=lease_s)


async def test_a_claim_for_workers_that_retire_meanwhile_gives_their_tasks_back_and_never_runs_more_than_max(
        tmp_path: Path) -> None:
    """The one claim out counts three idle workers; the pool shrinks to one before it answers. The two
    tasks it leased for the retired workers go back to the queue at once (they would wait for the one
    worker left, however long its task runs), and the retired workers start none of them."""
    store = HeldClaim(tmp_path / "tidepool.db")
    gate, plugins = gated()
    config = PoolConfig(min_workers=3, max_workers=3, poll_interval_s=30.0)
    async with running_node(store, plugins, pool=config, work_root=tmp_path) as node:
        with anyio.fail_after(5):
            await store.out.wait()
        ids = await node.submit_many("blocked", 3)
        node.pool.resize(min_workers=1, max_workers=1)
        store.go.set()
        await running(node, 1)
        with anyio.fail_after(2):  # while the one running task still runs
            while [(await node.store.get(i)).state for i in ids].count(State.PENDING) < 2:
                await anyio.sleep(0.01)
        assert store.claims == [(3, 3)]
        given_back = [t for t in [await node.store.get(i) for i in ids] if t.state is State.PENDING]
        assert [[a.status for a in t.attempts] for t in given_back] == [[AttemptStatus.INTERRUPTED]] * 2
        assert all(t.attempt == 0 for t in given_back), "given back, no attempt charged"
        assert sum(e.name == "plugin.started" for e in node.seen) == 1
        assert node.pool.statistics().busy == 1
        gate.set()
        tasks = [await node.finished(task_id) for task_id in ids]
    assert [t.state for t in tasks] == [State.COMPLETED] * 3


async def test_a_worker_counted_out_only_by_a_stale_parked_id_claims_instead_of_waiting_for_no_claim(
        tmp_path: Path) -> None:
    """A parked id whose task ended while it waited (a cancel) still counts against the claim's limit; with
    no claim in flight there is no answer to wait for: the worker drops it and claims."""
    store = SqliteStore(tmp_path / "tidepool.db")
    gate, plugins = gated()
    config = PoolConfig(min_workers=2, max_workers=2, poll_interval_s=30.0)
    async with running_node(store, plugins, pool=config, work_root=tmp_path) as node:
        await node.submit_many("blocked", 1)
        await running(node, 1)
        await node.until(lambda: node.pool.statistics().claiming and not node.pool._in_claim)
        idle = next(w for w in node.pool._workers.values() if not w.busy)
        node.pool.handoff._waiting["an-attempt-that-ended"] = None
        task, _ = await node.store.add(NewTask("blocked", {}), now=time.time())  # no wake: the sleeper sleeps on
        task_id = task.id
        with anyio.fail_after(2):
            started = await node.pool._claim(idle, Worker("test-node", "i1", idle.id))
        assert started is not None and started[0].task.id == task_id
        node.pool.handoff.put(started[0], idle.id)
        node.pool.handoff.give_back_all()
        gate.set()


async def test_the_wake_for_tasks_a_claim_parked_reaches_only_this_pools_workers(tmp_path: Path) -> None:
    """On a gateway the node's wake also wakes remote workers and their parked acquires, each then asking the
    store for nothing: the tasks one claim parked for this pool's idle workers are no new work for them."""
    reached: list[int] = []
    store = RecordingStore(tmp_path / "tidepool.db")
    gate, plugins = gated()
    config = PoolConfig(min_workers=4, max_workers=4, poll_interval_s=30.0)
    waker = WakerWithGateway(also=reached.append)
    async with running_node(store, plugins, pool=config, work_root=tmp_path, waker=waker) as node:
        await node.until(lambda: store.claims == [(4, 0)])
        reached.clear()
        await node.store.add_many([NewTask("blocked", {}) for _ in range(4)], now=time.time())
        node.pool.wake(1)  # new work: for everyone; the worker it wakes claims for all four
        await running(node, 4)
        assert store.claims[1:] == [(4, 4)]
        assert reached == [1], "the three parked tasks' hand-off went to the pool's workers only"
        gate.set()
