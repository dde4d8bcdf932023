"""The scans' contract on every store: a scan's jobs move in the transactions that end their tasks."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import anyio
import asyncpg
import pytest

from tidepool.errors import Conflict, InvalidRequest, QueueFull, ScanNotFound, TaskNotFound
from tidepool.model import (
    AttemptStatus,
    Claimed,
    ClaimFilter,
    NewTask,
    Outcome,
    State,
    TaskError,
    Worker,
    canonical_json,
)
from tidepool.scans import SCOPE_MAX_BYTES, JobState, NewScan, Scan, ScanState, StepSpec
from tidepool.store import Store
from tidepool.store.memory import MemoryStore
from tidepool.store.port import Ending, ScanCancel, ScanMove
from tidepool.store.sqlite import SqliteStore

from .conftest import LEASE_S, POLICY, T0

NODE = Worker("node-a", "a-1", "worker-1")
WEB = NewScan("web", (StepSpec("tcp_connect", max_attempts=2), StepSpec("http_probe", timeout_s=9.0,
                                                                           required_tags=("net",)),
                      StepSpec("report")), payload={"target": "10.0.0.1", "ports": [80, 8080]}, priority=5,
              organization="acme")
FAILED_FOR_GOOD = Outcome(AttemptStatus.FAILED, TaskError("invalid_argument", "target: refused", False))
TIMED_OUT = Outcome(AttemptStatus.TIMED_OUT, TaskError("timeout", "run phase timed out after 5.0s", False))
NET = ClaimFilter(tag_sets=(frozenset({"net"}),))


def learned(**scope: Any) -> Outcome:
    return Outcome(AttemptStatus.SUCCEEDED, scope=scope)


async def claim_step(store: Store, scan: Scan, index: int, *, now: float = T0) -> Claimed:
    """Claim the job's task (and only it): its id is the job's."""
    task_id = (await store.get_scan(scan.id)).jobs[index].task_id
    claimed = await store.claim(NODE, NET, limit=100, now=now, lease_s=LEASE_S)
    mine = [c for c in claimed if c.task.id == task_id]
    for other in claimed:
        if other.task.id != task_id:
            await store.finish(other.lease, Outcome(AttemptStatus.INTERRUPTED), now=now, policy=POLICY)
    assert mine, f"job {index}'s task {task_id} was not claimable"
    return mine[0]


async def end_step(store: Store, scan: Scan, index: int, outcome: Outcome, *, now: float | None = None) -> Scan:
    """Claim job `index`'s task at `now` (else when the scan last moved, when that task was made) and end it a
    second later."""
    now = (await store.get_scan(scan.id)).updated_at if now is None else now
    claimed = await claim_step(store, scan, index, now=now)
    await store.finish(claimed.lease, outcome, now=now + 1, policy=POLICY)
    return await store.get_scan(scan.id)


def states(scan: Scan) -> list[str]:
    return [j.state.value for j in scan.jobs]


async def end_behind_the_store(store: Store, task_id: str, state: State, *, now: float) -> None:
    """End a task as a crash between two writes would leave it: its row ended, its scan not moved."""
    if isinstance(store, MemoryStore):
        row = store._db.tasks[task_id]
        row.update(state=state, finished_at=now, updated_at=now)
        row.lease = None
    elif isinstance(store, SqliteStore):
        with sqlite3.connect(store.path) as conn:
            conn.execute("UPDATE tasks SET state = ?, finished_at = ?, lease_token = NULL WHERE id = ?",
                         (state.value, now, task_id))
    else:
        conn = await asyncpg.connect(store.url)  # type: ignore[attr-defined]
        try:
            await conn.execute(f'UPDATE "{store.schema}".tasks SET state = $1, finished_at = $2, '  # type: ignore[attr-defined]
                               "lease_token = NULL WHERE id = $3", state.value, now, task_id)
        finally:
            await conn.close()


# a scan and its first task


async def test_a_scan_is_created_with_its_first_jobs_task_which_has_the_steps_defaults(store: Store) -> None:
    scan, created = await store.add_scan(WEB, now=T0)
    assert created and scan.state is ScanState.PENDING and scan.profile == "web" and scan.organization == "acme"
    assert scan.payload == WEB.payload and scan.scope == {} and scan.created_at == T0 and scan.finished_at is None
    assert states(scan) == ["queued", "waiting", "waiting"]
    assert [j.step for j in scan.jobs] == ["tcp_connect", "http_probe", "report"]
    assert scan.jobs[0].task_id is not None and [j.task_id for j in scan.jobs[1:]] == [None, None]
    task = await store.get(scan.jobs[0].task_id)
    assert (task.type, task.payload, task.priority, task.max_attempts, task.state, task.organization) == (
        "tcp_connect", WEB.payload, 5, 2, State.PENDING, "acme")
    assert await store.get_scan(scan.id) == scan


async def test_same_key_and_body_is_the_scan_itself_another_body_a_conflict_creating_nothing(store: Store) -> None:
    keyed = NewScan("web", WEB.steps, payload={"target": "a"}, idempotency_key="k1")
    first, _ = await store.add_scan(keyed, now=T0)
    again, created = await store.add_scan(keyed, now=T0 + 5)
    assert not created and again.id == first.id
    with pytest.raises(Conflict, match="k1"):
        await store.add_scan(NewScan("web", WEB.steps, payload={"target": "b"}, idempotency_key="k1"), now=T0)
    assert [s.id for s in (await store.list_scans()).scans] == [first.id]
    assert len((await store.list_tasks()).tasks) == 1


@pytest.mark.parametrize("kind", ["postgres"])
async def test_two_submits_of_one_key_at_once_on_two_nodes_are_one_scan_or_a_conflict(store: Store) -> None:
    """The later submit's insert waits for the earlier one's transaction, then finds its scan by the key."""
    from tidepool.store.postgres import PostgresStore
    from tidepool.store.postgres import scans as pg_scans

    other = PostgresStore(store.url, schema=store.schema)  # type: ignore[attr-defined]
    await other.open()
    try:
        for key, payload, expected in (("k1", {"target": "a"}, None), ("k2", {"target": "b"}, Conflict)):
            answers: list[tuple[Scan, bool] | Exception] = []

            async def submit(body: NewScan, answers: list[tuple[Scan, bool] | Exception] = answers) -> None:
                try:
                    answers.append(await other.add_scan(body, now=T0 + 1))
                except Conflict as exc:
                    answers.append(exc)

            first = NewScan("web", WEB.steps, payload={"target": "a"}, idempotency_key=key)
            async with anyio.create_task_group() as tg, store._db.conn() as conn, conn.transaction():  # type: ignore[attr-defined]
                scan, created = await pg_scans.insert(conn, first, T0, None)
                tg.start_soon(submit, NewScan("web", WEB.steps, payload=payload, idempotency_key=key))
                await wait_for_a_lock_wait(store)  # the other node's insert of the key waits for this one
            if expected is None:
                assert created and answers == [(await store.get_scan(scan.id), False)]
            else:
                assert isinstance(answers[0], Conflict) and key in str(answers[0])
        assert len((await store.list_scans()).scans) == 2 and len((await store.list_tasks()).tasks) == 2
    finally:
        await other.close()


async def test_a_scan_over_max_queued_is_refused_and_creates_nothing(store: Store) -> None:
    await store.add(NewTask("noop"), now=T0)
    with pytest.raises(QueueFull):
        await store.add_scan(WEB, now=T0, max_queued=1)
    assert (await store.list_scans()).scans == []
    assert len((await store.list_tasks()).tasks) == 1


async def test_an_unknown_scan_is_scan_not_found(store: Store) -> None:
    for call in (store.get_scan("nope"), store.cancel_scan("nope", now=T0), store.retry_job("nope", 0, now=T0)):
        with pytest.raises(ScanNotFound) as caught:
            await call
        assert caught.value.code == "scan_not_found" and caught.value.http_status == 404


# a step's end, its scope and the next step's task, in one call


async def test_a_steps_success_merges_its_scope_and_creates_the_next_task_with_it(store: Store) -> None:
    told: list[ScanMove] = []
    store.on_scan_moves(told.extend)
    scan, _ = await store.add_scan(WEB, now=T0)
    scan = await end_step(store, scan, 0, learned(open_ports=[80, 8080], target="10.0.0.1"))
    assert scan.state is ScanState.RUNNING and scan.scope == {"open_ports": [80, 8080], "target": "10.0.0.1"}
    assert states(scan) == ["success", "queued", "waiting"]
    step = await store.get(scan.jobs[1].task_id or "")
    assert step.type == "http_probe" and step.priority == 5 and step.timeout_s == 9.0
    assert step.required_tags == ("net",) and step.max_attempts == 3 and step.organization == "acme"
    assert step.payload == {"target": "10.0.0.1", "ports": [80, 8080], "open_ports": [80, 8080]}
    assert told == [ScanMove(scan.id, "web", 0, JobState.SUCCESS, step.id, "http_probe", 1)]

    scan = await end_step(store, scan, 1, learned(open_ports=[8080], http={"8080": "http"}), now=T0 + 10)
    assert scan.scope == {"open_ports": [8080], "target": "10.0.0.1", "http": {"8080": "http"}}  # newer key wins
    scan = await end_step(store, scan, 2, learned(), now=T0 + 20)
    assert scan.state is ScanState.SUCCEEDED and scan.finished_at == T0 + 21
    assert states(scan) == ["success"] * 3 and [j.attempts for j in scan.jobs] == [1, 1, 1]
    assert told[-1].finished is ScanState.SUCCEEDED and told[-1].index == 2


async def test_a_steps_success_among_other_tasks_successes_in_one_call_moves_its_scan(store: Store) -> None:
    """The successes of tasks outside scans share the grouped completion; a step's goes its own way beside
    them, in the same call."""
    plain = [(await store.add(NewTask("noop"), now=T0))[0] for _ in range(2)]
    scan, _ = await store.add_scan(WEB, now=T0)
    claimed = {c.task.id: c for c in await store.claim(NODE, NET, limit=10, now=T0, lease_s=LEASE_S)}
    order = [plain[0].id, scan.jobs[0].task_id or "", plain[1].id]
    ends = [Ending(claimed[i].lease, learned(seen=i), T0 + 1) for i in order]
    assert await store.finish_many(ends, policy=POLICY) == [State.COMPLETED] * 3
    scan = await store.get_scan(scan.id)
    assert states(scan) == ["success", "queued", "waiting"] and scan.scope == {"seen": order[1]}
    assert [(await store.get(t.id)).state for t in plain] == [State.COMPLETED] * 2


async def test_a_retried_attempt_of_a_step_is_the_same_job_and_task(store: Store) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    retryable = Outcome(AttemptStatus.FAILED, TaskError("boom", "the plugin broke", True))
    scan = await end_step(store, scan, 0, retryable)
    assert states(scan) == ["queued", "waiting", "waiting"] and scan.state is ScanState.RUNNING
    claimed = await store.claim(NODE, NET, limit=5, now=T0 + 1000, lease_s=LEASE_S)
    assert [c.task.id for c in claimed] == [scan.jobs[0].task_id]
    assert states(await store.get_scan(scan.id)) == ["running", "waiting", "waiting"]
    await store.finish(claimed[0].lease, learned(n=1), now=T0 + 1001, policy=POLICY)
    scan = await store.get_scan(scan.id)
    assert states(scan) == ["success", "queued", "waiting"] and scan.jobs[0].attempts == 2


async def test_an_interrupted_attempt_of_a_scans_first_step_counts_as_started(store: Store) -> None:
    """An interruption gives its attempt back to the task's count, but it ran: the scan is no longer pending."""
    scan, _ = await store.add_scan(WEB, now=T0)
    claimed = await claim_step(store, scan, 0)
    await store.finish(claimed.lease, Outcome(AttemptStatus.INTERRUPTED), now=T0 + 1, policy=POLICY)
    scan = await store.get_scan(scan.id)
    assert scan.state is ScanState.RUNNING and states(scan) == ["queued", "waiting", "waiting"]
    assert scan.jobs[0].attempts == 1 and (await store.get(claimed.task.id)).attempt == 0
    assert [s.id for s in (await store.list_scans(state=ScanState.RUNNING)).scans] == [scan.id]
    assert (await store.list_scans(state=ScanState.PENDING)).scans == []


@pytest.mark.parametrize("outcome, shown", [(FAILED_FOR_GOOD, "failed"), (TIMED_OUT, "timeout")])
async def test_a_step_failed_or_timed_out_fails_the_scan_and_skips_the_rest(
        store: Store, outcome: Outcome, shown: str) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    scan = await end_step(store, scan, 0, learned(a=1))
    scan = await end_step(store, scan, 1, outcome)
    assert scan.state is ScanState.FAILED and scan.finished_at == T0 + 2
    assert states(scan) == ["success", shown, "skipped"] and scan.jobs[2].task_id is None
    assert scan.jobs[1].error is not None and scan.jobs[1].error.code == (outcome.error and outcome.error.code)
    assert scan.scope == {"a": 1}


async def test_a_step_whose_last_lease_expires_fails_the_scan(store: Store) -> None:
    scan, _ = await store.add_scan(NewScan("one", (StepSpec("a", max_attempts=1), StepSpec("b"))), now=T0)
    await claim_step(store, scan, 0)
    await store.expire_leases(now=T0 + LEASE_S + 1, policy=POLICY)
    scan = await store.get_scan(scan.id)
    assert scan.state is ScanState.FAILED and states(scan) == ["failed", "skipped"]


async def test_with_continue_on_failure_every_step_runs_and_the_scan_ends_failed(store: Store) -> None:
    steps = (StepSpec("a"), StepSpec("b"), StepSpec("c"))
    scan, _ = await store.add_scan(NewScan("lenient", steps, continue_on_failure=True), now=T0)
    scan = await end_step(store, scan, 0, learned(x=1))
    scan = await end_step(store, scan, 1, FAILED_FOR_GOOD)
    assert states(scan) == ["success", "failed", "queued"]
    assert (await store.get(scan.jobs[2].task_id or "")).payload == {"x": 1}  # the failed step learned nothing
    scan = await end_step(store, scan, 2, learned())
    assert scan.state is ScanState.FAILED and states(scan) == ["success", "failed", "success"]


async def test_several_steps_successes_in_one_call_move_each_scan_and_a_refused_one_fails_alone(
        store: Store) -> None:
    """Step successes of one call end together where a store groups them; one whose scope its scan refuses
    still fails alone, saying why, and the others move their scans as if each had ended on its own."""
    scans = [(await store.add_scan(WEB, now=T0))[0] for _ in range(3)]
    claimed = {c.task.id: c for c in await store.claim(NODE, NET, limit=10, now=T0, lease_s=LEASE_S)}
    outcomes = [learned(seen=0), learned(blob="x" * SCOPE_MAX_BYTES), learned(seen=2)]
    ends = [Ending(claimed[s.jobs[0].task_id or ""].lease, o, T0 + 1) for s, o in zip(scans, outcomes, strict=True)]
    assert await store.finish_many(ends, policy=POLICY) == [State.COMPLETED, State.FAILED, State.COMPLETED]
    ok, refused, other = [await store.get_scan(s.id) for s in scans]
    assert states(ok) == states(other) == ["success", "queued", "waiting"]
    assert (ok.scope, other.scope) == ({"seen": 0}, {"seen": 2}) and ok.jobs[1].task_id != other.jobs[1].task_id
    assert refused.state is ScanState.FAILED and states(refused) == ["failed", "skipped", "skipped"]
    nexts = [await store.get(s.jobs[1].task_id or "") for s in (ok, other)]
    assert [t.payload for t in nexts] == [{**WEB.payload, "seen": 0}, {**WEB.payload, "seen": 2}]


@contextlib.asynccontextmanager
async def traced_writer(adapter: Store, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[str]]:
    """The SQLite adapter opened with every statement its writer runs recorded, in order."""
    assert isinstance(adapter, SqliteStore)
    statements: list[str] = []
    connect = adapter._db.connect_writer

    def traced(migrate: bool) -> tuple[sqlite3.Connection, int]:
        conn, version = connect(migrate)
        conn.set_trace_callback(statements.append)
        return conn, version

    monkeypatch.setattr(adapter._db, "connect_writer", traced)
    await adapter.open()
    try:
        yield statements
    finally:
        await adapter.close()


def step_pass(statements: list[str]) -> list[str]:
    """The statements of the pass that ends step successes together and moves their scans."""
    return [s for s in statements if s.endswith("steps") or "RETURNING tasks.lease_attempt_id" in s
            or "FROM scans" in s or "scan_jobs" in s]


@pytest.mark.parametrize("kind", ["sqlite"])
async def test_a_round_of_plain_successes_on_sqlite_runs_no_scan_step_statement(
        adapter: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    async with traced_writer(adapter, monkeypatch) as statements:
        await adapter.add_scan(WEB, now=T0)  # a scan's step queued beside them, not ended in this round
        await adapter.add_many([NewTask("noop") for _ in range(50)], now=T0)
        claimed = await adapter.claim(NODE, ClaimFilter(types=("noop",)), limit=50, now=T0, lease_s=LEASE_S)
        statements.clear()
        ends = [Ending(c.lease, learned(), T0 + 1) for c in claimed]
        assert await adapter.finish_many(ends, policy=POLICY) == [State.COMPLETED] * 50
        assert step_pass(statements) == []
        begin, tasks, attempts, commit = statements  # the grouped completion alone, in its transaction
        assert (begin, commit) == ("BEGIN IMMEDIATE", "COMMIT")
        assert "UPDATE tasks SET state = 'completed'" in tasks
        assert "UPDATE attempts SET status = 'succeeded'" in attempts


@pytest.mark.parametrize("kind", ["sqlite"])
async def test_a_mixed_round_on_sqlite_completes_the_plain_ones_and_moves_its_scans_together(
        adapter: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    async with traced_writer(adapter, monkeypatch) as statements:
        scans = [(await adapter.add_scan(WEB, now=T0))[0] for _ in range(3)]
        plain = [(await adapter.add(NewTask("noop"), now=T0))[0] for _ in range(4)]
        claimed = {c.task.id: c for c in await adapter.claim(NODE, NET, limit=10, now=T0, lease_s=LEASE_S)}
        order = [plain[0].id, scans[0].jobs[0].task_id, plain[1].id, scans[1].jobs[0].task_id, plain[2].id,
                 scans[2].jobs[0].task_id, plain[3].id]
        statements.clear()
        ends = [Ending(claimed[i or ""].lease, learned(seen=i), T0 + 1) for i in order]
        assert await adapter.finish_many(ends, policy=POLICY) == [State.COMPLETED] * 7
        assert not [s for s in statements if s == "SAVEPOINT op"], "no ending went the one-by-one way"
        assert len([s for s in step_pass(statements) if "RETURNING" in s]) == 1, "the three steps ended together"
        assert "ROLLBACK TO steps" not in statements
        for scan, task_id in zip(scans, order[1::2], strict=True):
            moved = await adapter.get_scan(scan.id)
            assert states(moved) == ["success", "queued", "waiting"] and moved.scope == {"seen": task_id}
        assert [(await adapter.get(t.id)).state for t in plain] == [State.COMPLETED] * 4


async def test_a_scope_past_its_bound_or_not_json_fails_that_step_saying_why(store: Store) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    scan = await end_step(store, scan, 0, learned(blob="x" * SCOPE_MAX_BYTES))
    assert scan.state is ScanState.FAILED and states(scan) == ["failed", "skipped", "skipped"] and scan.scope == {}
    task = await store.get(scan.jobs[0].task_id or "")
    assert task.state is State.FAILED and task.error is not None and task.error.code == "scope_too_large"
    assert str(SCOPE_MAX_BYTES) in task.error.message

    other, _ = await store.add_scan(WEB, now=T0)
    other = await end_step(store, other, 0, learned(ports={80, 443}))
    error = (await store.get(other.jobs[0].task_id or "")).error
    assert error is not None and error.code == "scope_not_json" and other.state is ScanState.FAILED

    for not_a_mapping in (["port", 80], "port=80"):  # a plugin that replaced ctx.scope with something else
        third, _ = await store.add_scan(WEB, now=T0)
        third = await end_step(store, third, 0, Outcome(AttemptStatus.SUCCEEDED, scope=not_a_mapping))  # type: ignore[arg-type]
        task = await store.get(third.jobs[0].task_id or "")
        assert task.state is State.FAILED and task.attempt == 1 < task.max_attempts  # not retried: it would fail again
        assert task.error is not None and task.error.code == "scope_not_json" and "mapping" in task.error.message
        assert third.state is ScanState.FAILED


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_scope_is_stored_as_the_compact_json_its_bound_is_measured_in(store: Store) -> None:
    """A scope just within its bound in compact UTF-8 would pass it with json.dumps' escapes and spaces."""
    name = "é" * (SCOPE_MAX_BYTES // 2 - 20)  # two bytes each in UTF-8, six as an escape
    scan, _ = await store.add_scan(WEB, now=T0)
    scan = await end_step(store, scan, 0, learned(name=name, seen=[1, 2]))
    assert scan.state is ScanState.RUNNING and scan.scope == {"name": name, "seen": [1, 2]}
    step = await store.get(scan.jobs[1].task_id or "")
    stored_scope = await raw_value(store, "SELECT scope FROM scans WHERE id = ?", scan.id)
    stored_payload = await raw_value(store, "SELECT payload FROM tasks WHERE id = ?", step.id)
    assert stored_scope == canonical_json(scan.scope) and len(stored_scope.encode()) <= SCOPE_MAX_BYTES
    assert stored_payload == canonical_json(step.payload)


async def raw_value(store: Store, sql: str, arg: str) -> str:
    """One column as the store keeps it (`?` is the one parameter)."""
    if isinstance(store, SqliteStore):
        with contextlib.closing(sqlite3.connect(store.path)) as conn:
            return str(conn.execute(sql, (arg,)).fetchone()[0])
    conn = await asyncpg.connect(store.url, server_settings={"search_path": store.schema})  # type: ignore[attr-defined]
    try:
        return str(await conn.fetchval(sql.replace("?", "$1"), arg))
    finally:
        await conn.close()


async def test_a_steps_task_is_retried_as_its_job_not_on_its_own(store: Store) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    scan = await end_step(store, scan, 0, FAILED_FOR_GOOD)
    with pytest.raises(Conflict, match="jobs/0/retry"):
        await store.retry(scan.jobs[0].task_id or "", now=T0 + 5)
    assert (await store.get(scan.jobs[0].task_id or "")).state is State.FAILED


# cancel


async def test_cancelling_a_scan_whose_task_is_queued_ends_it_at_once(store: Store) -> None:
    told: list[ScanMove] = []
    store.on_scan_moves(told.extend)
    scan, _ = await store.add_scan(WEB, now=T0)
    answer = await store.cancel_scan(scan.id, now=T0 + 1)
    assert answer.state is ScanState.CANCELLED and answer.moved and answer.task_id == scan.jobs[0].task_id
    assert answer.task is not None and answer.task.state is State.CANCELLED and answer.task.type == "tcp_connect"
    scan = await store.get_scan(scan.id)
    assert scan.state is ScanState.CANCELLED and states(scan) == ["cancelled", "skipped", "skipped"]
    assert scan.finished_at == T0 + 1 and told[-1].finished is ScanState.CANCELLED
    assert not (await store.cancel_scan(scan.id, now=T0 + 2)).moved  # a repeated cancel changes nothing


async def test_cancelling_a_running_step_skips_the_rest_and_ends_the_scan_when_the_task_has(store: Store) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    scan = await end_step(store, scan, 0, learned(a=1))
    claimed = await claim_step(store, scan, 1, now=T0 + 2)
    answer = await store.cancel_scan(scan.id, now=T0 + 3)
    assert answer.state is ScanState.RUNNING and answer.task is not None and answer.task.state is State.CANCELLING
    scan = await store.get_scan(scan.id)
    assert scan.state is ScanState.RUNNING and states(scan) == ["success", "running", "skipped"]
    assert scan.cancel_requested_at == T0 + 3
    assert not (await store.cancel_scan(scan.id, now=T0 + 4)).moved
    # the worker stops: whatever it reports, the task ends cancelled, and so does the scan
    await store.finish(claimed.lease, learned(b=2), now=T0 + 5, policy=POLICY)
    scan = await store.get_scan(scan.id)
    assert scan.state is ScanState.CANCELLED and states(scan) == ["success", "cancelled", "skipped"]
    assert scan.scope == {"a": 1}


async def test_a_cancel_the_reconciler_finishes_ends_the_scan_by_its_next_pass(store: Store) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    await claim_step(store, scan, 0)
    await store.cancel_scan(scan.id, now=T0 + 1)
    await store.finish_cancels(now=T0 + 100, deadline_s=60.0)
    await store.advance_scans(now=T0 + 100)  # the reconciler's pass runs right after, in every store
    scan = await store.get_scan(scan.id)
    assert scan.state is ScanState.CANCELLED and states(scan) == ["cancelled", "skipped", "skipped"]


async def test_a_step_failed_as_unserviceable_fails_the_scan_by_the_next_pass(store: Store) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    scan = await end_step(store, scan, 0, learned())
    ended = await store.fail_unserviceable(frozenset({"net"}), now=T0 + 100, message="no resource has tags ['net']")
    assert [e.task_id for e in ended] == [scan.jobs[1].task_id]
    await store.advance_scans(now=T0 + 100)
    scan = await store.get_scan(scan.id)
    assert scan.state is ScanState.FAILED and states(scan) == ["success", "failed", "skipped"]
    assert scan.jobs[1].error is not None and scan.jobs[1].error.code == "unserviceable"


async def test_a_lenient_scans_step_failed_as_unserviceable_starts_the_next_step_and_says_so(store: Store) -> None:
    steps = (StepSpec("probe", required_tags=("net",)), StepSpec("report"))
    scan, _ = await store.add_scan(NewScan("lenient", steps, continue_on_failure=True), now=T0)
    moves: list[ScanMove] = []
    store.on_scan_moves(moves.extend)
    ended = await store.fail_unserviceable(frozenset({"net"}), now=T0 + 100, message="no resource has tags ['net']")
    assert [e.task_id for e in ended] == [scan.jobs[0].task_id]
    await store.advance_scans(now=T0 + 100)
    scan = await store.get_scan(scan.id)
    assert states(scan) == ["failed", "queued"]
    assert any(m.task_id == scan.jobs[1].task_id for m in moves)


async def test_a_steps_task_cancelled_on_its_own_cancels_the_scan(store: Store) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    await store.request_cancel(scan.jobs[0].task_id or "", now=T0 + 1)
    scan = await store.get_scan(scan.id)
    assert scan.state is ScanState.CANCELLED and states(scan) == ["cancelled", "skipped", "skipped"]


@pytest.mark.parametrize("kind", ["postgres"])
async def test_a_cancel_that_meets_its_scans_step_ending_under_it_cancels_the_next_steps_task(store: Store) -> None:
    """The cancel reads the live task before it locks it: a step that ends meanwhile leaves the next step's task
    live, and the cancel takes that one instead, in the same call."""
    from tidepool.store.postgres import scans as pg_scans
    from tidepool.store.postgres import tasks as pg_tasks

    scan, _ = await store.add_scan(WEB, now=T0)
    step = await claim_step(store, scan, 0)
    answers: list[ScanCancel] = []

    async def cancel() -> None:
        answers.append(await store.cancel_scan(scan.id, now=T0 + 2))

    async with anyio.create_task_group() as tg, store._db.conn() as ending, ending.transaction():  # type: ignore[attr-defined]
        await pg_tasks.locked_task(ending, step.task.id)  # the step's end holds its task, as finish does
        tg.start_soon(cancel)
        await wait_for_a_lock_wait(store)  # the cancel read the step's task as live and waits for it
        await ending.execute("UPDATE tasks SET state = 'completed', finished_at = $2, lease_token = NULL "
                             "WHERE id = $1", step.task.id, T0 + 1)
        await pg_scans.step_ended(ending, [], scan_id=scan.id, index=0, task_id=step.task.id,
                                  state=State.COMPLETED, learned={"port": 80}, now=T0 + 1)
    scan = await store.get_scan(scan.id)
    assert answers[0].state is ScanState.CANCELLED and answers[0].task_id == scan.jobs[1].task_id
    assert states(scan) == ["success", "cancelled", "skipped"] and scan.scope == {"port": 80}


async def wait_for_a_lock_wait(store: Store) -> None:
    """Until one of the store's connections waits for a row lock."""
    admin = await asyncpg.connect(store.url)  # type: ignore[attr-defined]
    try:
        while not await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                                       "AND wait_event_type = 'Lock'", f"tidepool {store.schema}"):  # type: ignore[attr-defined]
            await anyio.sleep(0.01)
    finally:
        await admin.close()


async def test_an_ended_scan_other_than_cancelled_cannot_be_cancelled(store: Store) -> None:
    scan, _ = await store.add_scan(NewScan("one", (StepSpec("a"),)), now=T0)
    await end_step(store, scan, 0, learned())
    with pytest.raises(Conflict, match="succeeded"):
        await store.cancel_scan(scan.id, now=T0 + 5)


# retry of a job


async def test_retrying_a_failed_job_resumes_from_it_with_the_scope_before_it(store: Store) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    scan = await end_step(store, scan, 0, learned(open_ports=[80]))
    scan = await end_step(store, scan, 1, FAILED_FOR_GOOD)
    failed_task = scan.jobs[1].task_id
    scan = await store.retry_job(scan.id, 1, now=T0 + 50)
    assert scan.state is ScanState.RUNNING and scan.finished_at is None
    assert states(scan) == ["success", "queued", "waiting"] and scan.jobs[1].tasks == 2
    assert scan.jobs[1].task_id != failed_task and scan.scope == {"open_ports": [80]}
    task = await store.get(scan.jobs[1].task_id or "")
    assert task.payload == {**WEB.payload, "open_ports": [80]} and task.type == "http_probe"
    assert (await store.get(failed_task or "")).state is State.FAILED  # the failed one stays, for the record
    scan = await end_step(store, scan, 1, learned(http=True), now=T0 + 60)
    scan = await end_step(store, scan, 2, learned(), now=T0 + 70)
    assert scan.state is ScanState.SUCCEEDED and scan.scope == {"open_ports": [80], "http": True}


async def test_retrying_a_job_of_a_lenient_scan_runs_every_step_after_it_again_from_its_scope(store: Store) -> None:
    steps = (StepSpec("a"), StepSpec("b"), StepSpec("c"))
    scan, _ = await store.add_scan(NewScan("lenient", steps, continue_on_failure=True), now=T0)
    scan = await end_step(store, scan, 0, learned(x=1))
    scan = await end_step(store, scan, 1, FAILED_FOR_GOOD)
    scan = await end_step(store, scan, 2, learned(z=3))
    assert scan.scope == {"x": 1, "z": 3}
    scan = await store.retry_job(scan.id, 1, now=T0 + 10)
    assert scan.scope == {"x": 1} and states(scan) == ["success", "queued", "waiting"]
    scan = await end_step(store, scan, 1, learned(y=2), now=T0 + 20)
    assert (await store.get(scan.jobs[2].task_id or "")).payload == {"x": 1, "y": 2}
    assert scan.jobs[2].tasks == 2


async def test_only_a_failed_timed_out_or_cancelled_job_of_an_ended_scan_is_retried(store: Store) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    with pytest.raises(Conflict, match="only a job of an ended scan"):
        await store.retry_job(scan.id, 0, now=T0)
    scan = await end_step(store, scan, 0, learned())
    scan = await end_step(store, scan, 1, FAILED_FOR_GOOD)
    for index, why in ((0, "success"), (2, "skipped")):
        with pytest.raises(Conflict, match=why):
            await store.retry_job(scan.id, index, now=T0)
    with pytest.raises(InvalidRequest) as caught:
        await store.retry_job(scan.id, 3, now=T0)
    assert caught.value.field == "index"
    assert await store.get_scan(scan.id) == scan  # nothing changed
    await store.add(NewTask("noop"), now=T0)
    with pytest.raises(QueueFull):
        await store.retry_job(scan.id, 1, now=T0, max_queued=1)
    assert await store.get_scan(scan.id) == scan


async def test_a_cancelled_scan_retried_from_its_cancelled_job_runs_on(store: Store) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    await store.cancel_scan(scan.id, now=T0)
    scan = await store.retry_job(scan.id, 0, now=T0 + 1)
    assert scan.cancel_requested_at is None and states(scan) == ["queued", "waiting", "waiting"]
    scan = await end_step(store, scan, 0, learned(), now=T0 + 2)
    assert states(scan) == ["success", "queued", "waiting"]


# the reconciler: a scan left between steps


async def test_a_step_ended_without_its_scan_moving_is_completed_by_the_reconciler(store: Store) -> None:
    scan, _ = await store.add_scan(WEB, now=T0)
    await claim_step(store, scan, 0)
    await end_behind_the_store(store, scan.jobs[0].task_id or "", State.COMPLETED, now=T0 + 1)
    assert states(await store.get_scan(scan.id)) == ["success", "waiting", "waiting"]  # read from its task
    moves = await store.advance_scans(now=T0 + 5)
    scan = await store.get_scan(scan.id)
    assert states(scan) == ["success", "queued", "waiting"]
    assert moves == [ScanMove(scan.id, "web", 0, JobState.SUCCESS, scan.jobs[1].task_id, "http_probe", 1)]
    assert await store.advance_scans(now=T0 + 6) == []  # nothing left to do: no second task for the job
    assert len((await store.list_tasks(type="http_probe")).tasks) == 1

    await claim_step(store, scan, 1, now=T0 + 7)
    await end_behind_the_store(store, scan.jobs[1].task_id or "", State.FAILED, now=T0 + 8)
    await store.advance_scans(now=T0 + 9)
    scan = await store.get_scan(scan.id)
    assert scan.state is ScanState.FAILED and states(scan) == ["success", "failed", "skipped"]


async def test_a_scan_whose_jobs_all_ended_is_ended_by_the_reconciler(store: Store) -> None:
    scan, _ = await store.add_scan(NewScan("one", (StepSpec("a"),)), now=T0)
    await end_behind_the_store(store, scan.jobs[0].task_id or "", State.COMPLETED, now=T0 + 1)
    await store.advance_scans(now=T0 + 2)
    scan = await store.get_scan(scan.id)
    assert scan.state is ScanState.SUCCEEDED and scan.finished_at == T0 + 2


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_jobs_tasks_are_unique_by_scan_index_and_retry_number(store: Store) -> None:
    """Whatever writes a job's task (a step's end, the reconciler, a retry), the schema refuses a second one
    with the same retry number."""
    scan, _ = await store.add_scan(WEB, now=T0)
    again = ("t2", "tcp_connect", "{}", 0, "pending", 3, "[]", "", T0, T0, T0, scan.id, 0, 0)
    columns = ("id, type, payload, priority, state, max_attempts, required_tags, fingerprint, created_at, updated_at, "
               "available_at, scan_id, scan_index, scan_retry")
    if isinstance(store, SqliteStore):
        with sqlite3.connect(store.path) as conn, pytest.raises(sqlite3.IntegrityError):
            conn.execute(f"INSERT INTO tasks ({columns}) VALUES ({', '.join('?' * len(again))})", again)
    else:
        conn = await asyncpg.connect(store.url)  # type: ignore[attr-defined]
        try:
            with pytest.raises(asyncpg.UniqueViolationError):
                await conn.execute(f'INSERT INTO "{store.schema}".tasks ({columns}) VALUES '  # type: ignore[attr-defined]
                                   f"({', '.join(f'${i + 1}' for i in range(len(again)))})",
                                   *again[:6], [], *again[7:])
        finally:
            await conn.close()


# reads


async def test_scans_list_newest_first_by_state_and_profile_in_pages(store: Store) -> None:
    async def submit(i: int, profile: str) -> str:
        return (await store.add_scan(NewScan(profile, (StepSpec("a"), StepSpec("b"))), now=T0 + i))[0].id

    ids = [await submit(0, "web"), await submit(1, "web")]
    await end_step(store, await store.get_scan(ids[1]), 0, learned(), now=T0 + 10)  # starts an attempt of ids[0]'s too
    await store.cancel_scan(ids[0], now=T0 + 11)
    ids += [await submit(2, "dns"), await submit(3, "web")]  # nothing of these has run
    page = await store.list_scans(limit=3)
    assert [s.id for s in page.scans] == ids[::-1][:3] and page.next_cursor == ids[1]
    rest = await store.list_scans(limit=3, cursor=page.next_cursor)
    assert [s.id for s in rest.scans] == [ids[0]] and rest.next_cursor is None
    by = {state: [s.id for s in (await store.list_scans(state=state)).scans] for state in ScanState}
    assert by == {ScanState.PENDING: [ids[3], ids[2]], ScanState.RUNNING: [ids[1]], ScanState.CANCELLED: [ids[0]],
                  ScanState.SUCCEEDED: [], ScanState.FAILED: []}
    assert [s.id for s in (await store.list_scans(profile="web", state=ScanState.PENDING)).scans] == [ids[3]]


@pytest.mark.parametrize("kind", ["sqlite"])
async def test_a_scan_is_read_with_its_jobs_as_of_one_time_on_sqlite(store: Store) -> None:
    """A prune that lands between the read of a scan's row and of its jobs is not seen by either."""
    assert isinstance(store, SqliteStore) and store._reader is not None
    scan, _ = await store.add_scan(NewScan("one", (StepSpec("a"),)), now=T0)
    scan = await end_step(store, scan, 0, learned(port=80))
    prune: list[str] = [scan.id]  # the scan the next read of jobs sees pruned just before it runs

    def prune_before_the_jobs_are_read(statement: str) -> None:
        if "FROM scan_jobs" in statement and prune:
            with contextlib.closing(sqlite3.connect(store.path)) as other, other:
                other.execute("DELETE FROM scan_jobs WHERE scan_id = ?", (prune[0],))
                other.execute("DELETE FROM scans WHERE id = ?", (prune.pop(),))

    store._reader.set_trace_callback(prune_before_the_jobs_are_read)
    try:
        assert await store.get_scan(scan.id) == scan and not prune
        with pytest.raises(ScanNotFound):
            await store.get_scan(scan.id)
        second, _ = await store.add_scan(NewScan("one", (StepSpec("a"),)), now=T0 + 1)
        second = await end_step(store, second, 0, learned())
        prune.append(second.id)
        assert (await store.list_scans()).scans == [second] and not prune
        assert (await store.list_scans()).scans == []
    finally:
        store._reader.set_trace_callback(None)


async def test_ended_scans_are_pruned_with_their_tasks(store: Store) -> None:
    done, _ = await store.add_scan(NewScan("one", (StepSpec("a"),)), now=T0)
    done = await end_step(store, done, 0, learned())
    live, _ = await store.add_scan(NewScan("one", (StepSpec("a"),)), now=T0 + 2)
    await store.prune(before=T0 + 100)
    with pytest.raises(ScanNotFound):
        await store.get_scan(done.id)
    with pytest.raises(TaskNotFound):
        await store.get(done.jobs[0].task_id or "")
    live = await store.get_scan(live.id)
    assert live.state is ScanState.PENDING and (await store.get(live.jobs[0].task_id or "")).state is State.PENDING
