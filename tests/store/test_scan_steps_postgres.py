"""The PostgreSQL store's grouped step pass: the bare step successes of one finish_many end together, their scans
moved on in the same transaction, and whatever is not plain ends on its own beside them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import asyncpg
import pytest

from tidepool.errors import TidepoolError
from tidepool.model import Claimed, State
from tidepool.scans import SCOPE_MAX_BYTES, ScanState
from tidepool.store import Store
from tidepool.store.port import Ending, ScanCancel, ScanMove

from .conftest import LEASE_S, POLICY, T0
from .test_scans import NET, NODE, WEB, learned, states

pytestmark = pytest.mark.parametrize("kind", ["postgres"])

LOCK_STEPS = "-- The bare step successes"  # the grouped pass's first statement (its SQL's comment)
ENDING_ROW = "SELECT state, attempt, max_attempts"  # the one-by-one way's first read of a task


@contextlib.contextmanager
def statements_of(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every statement the store's pooled connections run meanwhile, in order (asyncpg's own type lookups
    left out)."""
    seen: list[str] = []
    db = store._db  # type: ignore[attr-defined]
    conn_of = db.conn

    def log(query: Any) -> None:
        if not any(lookup in query.query for lookup in ("typeinfo_tree", "current_setting('jit') AS cur")):
            seen.append(query.query.strip())

    @contextlib.asynccontextmanager
    async def logged(**kw: Any) -> AsyncIterator[Any]:
        async with conn_of(**kw) as conn:
            conn.add_query_logger(log)
            try:
                yield conn
            finally:
                conn.remove_query_logger(log)

    monkeypatch.setattr(db, "conn", logged)
    yield seen


def counted(statements: list[str], start: str) -> int:
    return sum(s.startswith(start) for s in statements)


async def first_steps(store: Store, n: int) -> list[tuple[str, Claimed]]:
    """n scans of WEB, each with its first step's task claimed: (scan id, claim)."""
    scans = [(await store.add_scan(WEB, now=T0))[0] for _ in range(n)]
    claimed = {c.task.id: c for c in await store.claim(NODE, NET, limit=n + 1, now=T0, lease_s=LEASE_S)}
    return [(s.id, claimed[s.jobs[0].task_id or ""]) for s in scans]


async def test_steps_of_several_scans_in_one_finish_end_together_and_each_scan_moves_on(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    told: list[ScanMove] = []
    store.on_scan_moves(told.extend)
    steps = await first_steps(store, 5)
    ends = [Ending(c.lease, learned(port=80 + i), T0 + 1) for i, (_, c) in enumerate(steps)]
    with statements_of(store, monkeypatch) as statements:
        assert await store.finish_many(ends, policy=POLICY) == [State.COMPLETED] * 5
    complete, begin, lock, write, commit = statements  # whatever the number of steps
    assert "scan_id IS NULL" in complete and "BEGIN;" in begin and commit == "COMMIT"
    assert lock.startswith(LOCK_STEPS) and "INSERT INTO tasks" in write
    for i, (scan_id, claimed) in enumerate(steps):
        scan = await store.get_scan(scan_id)
        assert states(scan) == ["success", "queued", "waiting"] and scan.scope == {"port": 80 + i}
        assert (await store.get(claimed.task.id)).state is State.COMPLETED
        step = await store.get(scan.jobs[1].task_id or "")
        assert step.type == "http_probe" and step.payload == {**WEB.payload, "port": 80 + i}
        assert (step.priority, step.organization, step.required_tags) == (5, "acme", ("net",))
    assert sorted(m.task_id or "" for m in told) == sorted([(await store.get_scan(s)).jobs[1].task_id or ""
                                                            for s, _ in steps])
    nexts = await store.claim(NODE, NET, limit=10, now=T0 + 2, lease_s=LEASE_S)
    assert sorted(c.task.id for c in nexts) == sorted(m.task_id or "" for m in told)  # queued, claimable


async def test_a_step_whose_scope_its_scan_refuses_fails_alone_saying_why_and_the_others_end_together(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = await first_steps(store, 4)
    outcomes = [learned(seen=0), learned(blob="x" * SCOPE_MAX_BYTES), learned(seen=2), learned(seen=3)]
    ends = [Ending(c.lease, o, T0 + 1) for (_, c), o in zip(steps, outcomes, strict=True)]
    with statements_of(store, monkeypatch) as statements:
        answers = await store.finish_many(ends, policy=POLICY)
    assert answers == [State.COMPLETED, State.FAILED, State.COMPLETED, State.COMPLETED]
    assert counted(statements, LOCK_STEPS) == 1 and counted(statements, ENDING_ROW) == 1  # only it alone
    refused = await store.get_scan(steps[1][0])
    assert refused.state is ScanState.FAILED and states(refused) == ["failed", "skipped", "skipped"]
    assert refused.scope == {} and refused.jobs[0].error is not None and "scope" in refused.jobs[0].error.message
    for index in (0, 2, 3):
        scan = await store.get_scan(steps[index][0])
        assert states(scan) == ["success", "queued", "waiting"] and scan.scope == {"seen": index}
        assert (await store.get(scan.jobs[1].task_id or "")).payload == {**WEB.payload, "seen": index}


async def raw(store: Store, *statements: tuple[str, tuple[Any, ...]]) -> None:
    """Write behind the store, as a crash or a race between nodes could leave its rows."""
    conn = await asyncpg.connect(store.url, server_settings={"search_path": store.schema})  # type: ignore[attr-defined]
    try:
        for sql, args in statements:
            await conn.execute(sql, *args)
    finally:
        await conn.close()


async def test_two_steps_of_one_scan_in_one_finish_end_on_their_own_and_only_the_live_one_moves_it(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second task of one job beside its first, both leased (what a job's task made again while an older
    one still ran would look like): both end, the job's live one alone moves the scan, once."""
    (scan_id, stale), (other_id, other) = await first_steps(store, 2)
    await raw(store, ("INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags, "
                      "fingerprint, created_at, updated_at, available_at, organization, scan_id, scan_index, "
                      "scan_retry, inputs) SELECT $2, type, payload, priority, 'pending', max_attempts, timeout_s, "
                      "required_tags, '', created_at, updated_at, available_at, organization, scan_id, scan_index, "
                      "1, inputs FROM tasks WHERE id = $1", (stale.task.id, "live-task")),
                 ("UPDATE scan_jobs SET task_id = $1, tasks = 2 WHERE scan_id = $2 AND idx = 0",
                  ("live-task", scan_id)))
    [live] = await store.claim(NODE, NET, limit=10, now=T0, lease_s=LEASE_S)
    assert live.task.id == "live-task"
    ends = [Ending(stale.lease, learned(old=True), T0 + 1), Ending(other.lease, learned(k=1), T0 + 1),
            Ending(live.lease, learned(new=True), T0 + 1)]
    with statements_of(store, monkeypatch) as statements:
        assert await store.finish_many(ends, policy=POLICY) == [State.COMPLETED] * 3
    assert counted(statements, LOCK_STEPS) == 1 and counted(statements, ENDING_ROW) == 2  # the two of one scan
    scan = await store.get_scan(scan_id)
    assert states(scan) == ["success", "queued", "waiting"] and scan.scope == {"new": True}
    assert scan.jobs[0].task_id == "live-task" and (await store.get(stale.task.id)).state is State.COMPLETED
    probes = (await store.list_tasks(type="http_probe", limit=100)).tasks
    assert len(probes) == 2  # one next step for each scan, not two for the one
    assert states(await store.get_scan(other_id)) == ["success", "queued", "waiting"]


async def test_a_cancel_racing_a_grouped_finish_cancels_the_next_step_it_made(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finish holds the steps' tasks and waits for one scan's row; that scan's cancel waits for its task
    meanwhile, then finds the next step's task live and cancels it: no deadlock, nothing lost."""
    steps = await first_steps(store, 3)
    target = steps[1][0]
    answers: list[list[State | TidepoolError]] = []
    cancelled: list[ScanCancel] = []

    async def finish() -> None:
        answers.append(await store.finish_many([Ending(c.lease, learned(i=i), T0 + 1)
                                                for i, (_, c) in enumerate(steps)], policy=POLICY))

    async def cancel() -> None:
        cancelled.append(await store.cancel_scan(target, now=T0 + 2))

    admin = await asyncpg.connect(store.url, server_settings={"search_path": store.schema})  # type: ignore[attr-defined]
    try:
        async with anyio.create_task_group() as tg, admin.transaction():
            await admin.execute("SELECT 1 FROM scans WHERE id = $1 FOR UPDATE", target)
            tg.start_soon(finish)
            await waiting(store, 1)  # the finish holds the three tasks and waits for the scan
            tg.start_soon(cancel)
            await waiting(store, 2)  # the cancel read the step's task as live and waits for it
    finally:
        await admin.close()
    assert answers == [[State.COMPLETED] * 3]
    scan = await store.get_scan(target)
    assert scan.state is ScanState.CANCELLED and states(scan) == ["success", "cancelled", "skipped"]
    assert scan.scope == {"i": 1} and cancelled[0].task_id == scan.jobs[1].task_id
    assert (await store.get(scan.jobs[1].task_id or "")).state is State.CANCELLED
    for i in (0, 2):
        other = await store.get_scan(steps[i][0])
        assert states(other) == ["success", "queued", "waiting"] and other.scope == {"i": i}


async def waiting(store: Store, n: int) -> None:
    """Until n of the store's connections wait for a lock."""
    admin = await asyncpg.connect(store.url)  # type: ignore[attr-defined]
    try:
        while await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                                   "AND wait_event_type = 'Lock'", f"tidepool {store.schema}") < n:  # type: ignore[attr-defined]
            await anyio.sleep(0.01)
    finally:
        await admin.close()



async def test_a_step_whose_scan_was_cancelled_before_its_finish_ends_alone_and_its_scan_cancelled(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = await first_steps(store, 3)
    target = steps[1][0]
    assert (await store.cancel_scan(target, now=T0 + 1)).state is ScanState.RUNNING  # its task is stopping
    ends = [Ending(c.lease, learned(i=i), T0 + 2) for i, (_, c) in enumerate(steps)]
    with statements_of(store, monkeypatch) as statements:
        answers = await store.finish_many(ends, policy=POLICY)
    assert answers == [State.COMPLETED, State.CANCELLED, State.COMPLETED]
    assert counted(statements, LOCK_STEPS) == 1 and counted(statements, ENDING_ROW) == 1
    scan = await store.get_scan(target)
    assert scan.state is ScanState.CANCELLED and states(scan) == ["cancelled", "skipped", "skipped"]
    assert scan.scope == {} and scan.jobs[1].task_id is None
    for i in (0, 2):
        other = await store.get_scan(steps[i][0])
        assert states(other) == ["success", "queued", "waiting"] and other.scope == {"i": i}
