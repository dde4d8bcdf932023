"""The store contract: every adapter passes the same tests, time passed in as `now=`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

from tidepool.errors import (
    Conflict,
    InvalidTransition,
    LeaseLost,
    QueueFull,
    StoreError,
    StoreUnavailable,
    TaskCancelling,
    TaskNotFound,
)
from tidepool.lifecycle import backoff_s
from tidepool.model import (
    CANCELLED_ON_REQUEST,
    AttemptStatus,
    Claimed,
    ClaimFilter,
    NewTask,
    Outcome,
    Phase,
    ResultBatch,
    State,
    Task,
    TaskError,
    Worker,
    cancel_deadline_error,
    new_id,
    sha256_of,
)
from tidepool.store import CancelAnswer, Ended, Ending, PhaseNote, Store
from tidepool.store.sqlite import SqliteStore

from .conftest import ANY, LEASE_S, POLICY, SUCCEEDED, T0

NODE_A = Worker("node-a", "a-1", "worker-1")

FAILED_RETRYABLE = Outcome(AttemptStatus.FAILED, TaskError("boom", "the plugin broke", True), 1, "boom\n")
FAILED_FOR_GOOD = Outcome(AttemptStatus.FAILED, TaskError("invalid_argument", "target: refused", False))
TIMED_OUT = Outcome(AttemptStatus.TIMED_OUT, TaskError("timeout", "run phase timed out after 5.0s", False))
CANCELLED = Outcome(AttemptStatus.CANCELLED, TaskError("cancelled", "cancelled on request", False))
INTERRUPTED = Outcome(AttemptStatus.INTERRUPTED, TaskError("interrupted", "interrupted by shutdown"))

sqlite_only = pytest.mark.parametrize("kind", ["sqlite"])


# helpers


async def add(store: Store, *, now: float = T0, type: str = "noop", **fields: Any) -> Task:
    task, created = await store.add(NewTask(type, **fields), now=now)
    assert created
    return task


async def claim(store: Store, *, now: float = T0, worker: Worker = NODE_A, where: ClaimFilter = ANY,
                limit: int = 10) -> list[Claimed]:
    return await store.claim(worker, where, limit=limit, now=now, lease_s=LEASE_S)


async def claim_one(store: Store, **kwargs: Any) -> Claimed:
    claimed = await claim(store, limit=1, **kwargs)
    assert len(claimed) == 1, "expected one claimable task"
    return claimed[0]


async def leased(store: Store, *, now: float = T0, worker: Worker = NODE_A, **fields: Any) -> Claimed:
    """A new task, claimed; it must be the only claimable task of its type."""
    task = await add(store, now=now, **fields)
    where = ClaimFilter((task.type,), (frozenset(task.required_tags),))  # a free slot with the task's tags
    c = await claim_one(store, now=now, worker=worker, where=where)
    assert c.task.id == task.id
    return c


async def running(store: Store, *, now: float = T0, **kwargs: Any) -> Claimed:
    c = await leased(store, now=now, **kwargs)
    assert await store.set_phase([PhaseNote(c.lease, Phase.RUN)], now=now) == {}
    return c


async def task_in(store: Store, state: State, *, now: float = T0, **fields: Any) -> Task:
    """A task of type `state` brought to `state` the way the daemon would."""
    if state is State.PENDING:
        return await add(store, now=now, type=state.value, **fields)
    if state is State.CANCELLED:
        task = await add(store, now=now, type=state.value, **fields)
        assert await store.request_cancel(task.id, now=now) == CancelAnswer(State.CANCELLED, True, task.type)
        return await store.get(task.id)
    c = await (leased if state is State.LEASED else running)(store, now=now, type=state.value, **fields)
    if state is State.CANCELLING:
        assert await store.request_cancel(c.task.id, now=now) == CancelAnswer(State.CANCELLING, True, c.task.type)
    elif state not in (State.LEASED, State.RUNNING):
        outcome = {State.RETRY_WAIT: FAILED_RETRYABLE, State.COMPLETED: SUCCEEDED,
                   State.FAILED: FAILED_FOR_GOOD, State.TIMED_OUT: TIMED_OUT}[state]
        assert await store.finish(c.lease, outcome, now=now, policy=POLICY) is state
    task = await store.get(c.task.id)
    assert task.state is state
    return task


def backoff_window(attempt: int, since: float) -> tuple[float, float]:
    delay = backoff_s(attempt, base_s=POLICY.base_s, max_s=POLICY.max_s, jitter=0.0)
    return since + delay * (1 - POLICY.jitter) - 1e-6, since + delay * (1 + POLICY.jitter) + 1e-6


def result(key: str = "r1", payload: Any = None, *, sequence: int = 0) -> ResultBatch:
    payload = {"open": [80, 443]} if payload is None else payload
    return ResultBatch("tcp_connect", sequence, key, sha256_of(payload), True, payload)


@contextlib.asynccontextmanager
async def changes_nothing(store: Store, *task_ids: str) -> AsyncIterator[None]:
    before = [await store.get(i) for i in task_ids]
    yield
    assert [await store.get(i) for i in task_ids] == before


async def all_pages(store: Store, *, limit: int, **filters: Any) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        page = await store.list_tasks(limit=limit, cursor=cursor, **filters)
        pages.append([t.id for t in page.tasks])
        if page.next_cursor is None:
            return pages
        cursor = page.next_cursor


# add, get, list


async def test_add_then_get_returns_every_task_field(store: Store) -> None:
    new = NewTask("scan", {"target": "192.0.2.10", "ports": [80, 443], "note": "zürich"}, priority=5,
                  max_attempts=4, timeout_s=12.5, required_tags=("win10", "gpu"), idempotency_key="k1",
                  available_at=T0 + 60)
    task, created = await store.add(new, now=T0)
    assert created
    assert (task.type, task.payload, task.priority, task.max_attempts, task.timeout_s) == \
        ("scan", new.payload, 5, 4, 12.5)
    assert (task.required_tags, task.idempotency_key) == (("gpu", "win10"), "k1")
    assert (task.state, task.phase, task.progress, task.attempt, task.interruptions) == \
        (State.PENDING, None, None, 0, 0)
    assert (task.node_id, task.error, task.finished_at) == (None, None, None)
    assert (task.created_at, task.updated_at, task.available_at) == (T0, T0, T0 + 60)
    assert (task.attempts, task.results) == ((), ())
    assert await store.get(task.id) == task
    assert (await add(store, now=T0 + 1)).available_at == T0 + 1  # due at once by default


async def test_unknown_task_id_raises_task_not_found(store: Store) -> None:
    unknown = new_id(T0)
    with pytest.raises(TaskNotFound):
        await store.get(unknown)
    with pytest.raises(TaskNotFound):
        await store.request_cancel(unknown, now=T0)
    with pytest.raises(TaskNotFound):
        await store.retry(unknown, now=T0)


async def test_list_is_newest_first_and_pages_have_no_gaps_or_repeats(store: Store) -> None:
    ids = [(await add(store, now=T0 + i)).id for i in range(25)]
    newest_first = ids[::-1]
    for limit, sizes in ((10, [10, 10, 5]), (5, [5] * 5), (50, [25])):
        pages = await all_pages(store, limit=limit)
        assert [len(p) for p in pages] == sizes
        assert [i for p in pages for i in p] == newest_first


async def test_list_filters_by_state_and_type(store: Store) -> None:
    scans = [(await add(store, now=T0 + i, type="scan")).id for i in range(3)]
    noops = [(await add(store, now=T0 + 3 + i, type="noop")).id for i in range(2)]
    held = await claim_one(store, where=ClaimFilter(("scan",)), now=T0 + 10)
    assert held.task.id == scans[0]

    def flat(pages: list[list[str]]) -> list[str]:
        return [i for p in pages for i in p]

    assert flat(await all_pages(store, limit=2, type="scan")) == scans[::-1]
    assert flat(await all_pages(store, limit=2, state=State.PENDING)) == [*noops[::-1], *scans[:0:-1]]
    assert flat(await all_pages(store, limit=2, state=State.LEASED, type="scan")) == [scans[0]]
    assert flat(await all_pages(store, limit=2, state=State.LEASED, type="noop")) == []


# idempotent submit and max_queued


async def test_same_key_and_body_returns_the_existing_task(store: Store) -> None:
    new = NewTask("scan", {"target": "a"}, idempotency_key="k")
    first, created = await store.add(new, now=T0)
    again, created_again = await store.add(new, now=T0 + 5)
    assert (created, created_again, again) == (True, False, first)
    assert len((await store.list_tasks()).tasks) == 1


async def test_same_key_with_another_start_time_is_a_conflict_the_same_one_the_task(store: Store) -> None:
    """available_at is part of the body: a client that reschedules under its key must not be told 200
    while its new time is dropped."""
    later = NewTask("scan", {"target": "a"}, idempotency_key="k", available_at=T0 + 3600)
    first, _ = await store.add(later, now=T0)
    assert (await store.add(later, now=T0 + 1))[0].id == first.id
    for other in (T0 + 7200, None):
        with pytest.raises(Conflict):
            await store.add(dataclasses.replace(later, available_at=other), now=T0 + 1)
    assert (await store.get(first.id)).available_at == T0 + 3600


async def test_same_key_with_another_body_is_a_conflict_and_changes_nothing(store: Store) -> None:
    first = await add(store, type="scan", payload={"target": "a"}, idempotency_key="k")
    async with changes_nothing(store, first.id):
        with pytest.raises(Conflict):
            await store.add(NewTask("scan", {"target": "b"}, idempotency_key="k"), now=T0 + 1)
    assert [t.id for t in (await store.list_tasks()).tasks] == [first.id]


async def test_add_many_with_a_key_used_for_another_body_or_repeated_inserts_nothing(store: Store) -> None:
    first = await add(store, idempotency_key="used")
    with pytest.raises(Conflict):
        await store.add_many([NewTask("noop"), NewTask("scan", idempotency_key="used")], now=T0)
    with pytest.raises(Conflict):
        await store.add_many([NewTask("noop", idempotency_key="twice")] * 2, now=T0)
    assert [t.id for t in (await store.list_tasks()).tasks] == [first.id]
    await add(store, idempotency_key="twice")  # the refused batch did not keep its key

    added = await store.add_many([NewTask("noop", {"n": n}) for n in range(3)], now=T0 + 1)
    ids = [task_id for task_id, _ in added]
    assert [(await store.get(i)).payload for i in ids] == [{"n": 0}, {"n": 1}, {"n": 2}]


async def test_a_resubmitted_batch_finds_its_keyed_tasks_and_adds_only_the_rest(store: Store) -> None:
    """A client that lost the answer to a batch sends it again: its keyed tasks are not made twice."""
    batch = [NewTask("noop", {"n": n}, idempotency_key=f"k{n}") for n in range(3)]
    first = await store.add_many(batch, now=T0)
    assert [created for _, created in first] == [True] * 3
    again = await store.add_many([*batch, NewTask("noop", {"n": 3})], now=T0 + 1, max_queued=4)
    assert again[:3] == [(task_id, False) for task_id, _ in first] and again[3][1]
    assert len((await store.list_tasks()).tasks) == 4
    # answered even with the queue over max_queued, as a single submit of a known key is
    assert await store.add_many(batch, now=T0 + 2, max_queued=1) == [(i, False) for i, _ in first]

    # two sends of one batch at once (a client's retry while the first is still in flight): one task each
    twice = [NewTask("noop", {"m": n}, idempotency_key=f"m{n}") for n in range(20)]
    a, b = await asyncio.gather(store.add_many(twice, now=T0 + 3), store.add_many(twice, now=T0 + 3))
    assert [i for i, _ in a] == [i for i, _ in b] and all(x != y for (_, x), (_, y) in zip(a, b, strict=True))
    assert len((await store.list_tasks(limit=100)).tasks) == 24


async def test_add_over_max_queued_raises_queue_full(store: Store) -> None:
    for n in range(3):
        await store.add(NewTask("noop", {"n": n}, idempotency_key=f"k{n}"), now=T0, max_queued=3)
    with pytest.raises(QueueFull):
        await store.add(NewTask("noop"), now=T0, max_queued=3)
    assert (await store.counts()).get(State.PENDING) == 3
    # resubmitting a known task is not a new one; a claimed task no longer counts as queued
    _, created = await store.add(NewTask("noop", {"n": 0}, idempotency_key="k0"), now=T0, max_queued=3)
    assert not created
    await claim_one(store)
    await store.add(NewTask("noop"), now=T0, max_queued=3)


async def test_add_many_that_would_exceed_max_queued_is_refused_whole(store: Store) -> None:
    await store.add_many([NewTask("noop")] * 2, now=T0)
    with pytest.raises(QueueFull):
        await store.add_many([NewTask("noop")] * 3, now=T0, max_queued=4)
    assert len((await store.list_tasks()).tasks) == 2
    assert len(await store.add_many([NewTask("noop")] * 2, now=T0, max_queued=4)) == 2


# claiming: only what the node can run, each task by one worker


async def test_claim_order_is_priority_then_oldest_first(store: Store) -> None:
    made = {(prio, at): (await add(store, now=T0 + at, priority=prio)).id
            for prio, at in ((0, 0), (5, 1), (0, 2), (5, 3), (9, 4), (-1, 5))}
    order = [made[k] for k in ((9, 4), (5, 1), (5, 3), (0, 0), (0, 2), (-1, 5))]
    first_two = await claim(store, now=T0 + 10, limit=2)
    rest = [(await claim_one(store, now=T0 + 10)).task.id for _ in range(4)]
    assert [c.task.id for c in first_two] + rest == order
    assert await claim(store, now=T0 + 10) == []


async def test_delayed_task_is_not_claimed_until_due(store: Store) -> None:
    task = await add(store, available_at=T0 + 60)
    assert await claim(store, now=T0 + 59.9) == []
    assert (await claim_one(store, now=T0 + 60)).task.id == task.id


async def test_claim_takes_only_the_types_named(store: Store) -> None:
    ids = {t: (await add(store, type=t)).id for t in ("scan", "scan.deep", "noop", "Scan")}
    assert [c.task.id for c in await claim(store, where=ClaimFilter(("scan",)))] == [ids["scan"]]
    assert [c.task.id for c in await claim(store, where=ClaimFilter(("sleep", "noop")))] == [ids["noop"]]
    assert await claim(store, where=ClaimFilter(())) == []  # a node that claims no type
    assert {(await store.get(ids[t])).state for t in ("scan.deep", "Scan")} == {State.PENDING}


async def test_required_tags_need_one_free_tag_set_that_covers_them(store: Store) -> None:
    ids = {tags: (await add(store, required_tags=tags)).id
           for tags in ((), ("win10",), ("gpu", "win10"), ("linux",))}
    split = ClaimFilter(tag_sets=(frozenset({"win10"}), frozenset({"gpu"})))
    assert {c.task.id for c in await claim(store, where=split)} == {ids[()], ids[("win10",)]}
    assert await claim(store) == []  # a node without free slots runs only tag-free tasks
    both = ClaimFilter(tag_sets=(frozenset({"win10", "gpu", "nic"}),))
    assert [c.task.id for c in await claim(store, where=both)] == [ids[("gpu", "win10")]]
    assert (await store.get(ids[("linux",)])).state is State.PENDING


async def test_task_without_attempts_left_is_never_claimed(store: Store) -> None:
    await add(store, type="spent", max_attempts=0)
    once = await running(store, type="once", max_attempts=1)
    assert await store.finish(once.lease, FAILED_RETRYABLE, now=T0, policy=POLICY) is State.FAILED
    assert await claim(store, now=T0 + 86400) == []


async def test_eight_concurrent_claimers_never_claim_a_task_twice(store: Store) -> None:
    added = await store.add_many([NewTask("noop")] * 200, now=T0)
    ids = [task_id for task_id, _ in added]

    async def claimer(n: int) -> list[Claimed]:
        mine: list[Claimed] = []
        worker = Worker("node-a", "a-1", f"worker-{n}")
        while got := await claim(store, worker=worker, now=T0 + 1, limit=1 + n % 3):
            mine.extend(got)
            await asyncio.sleep(0)  # let the other claimers in between claims
        return mine

    claimed = [c for mine in await asyncio.gather(*(claimer(n) for n in range(8))) for c in mine]
    assert Counter(c.task.id for c in claimed) == Counter(ids)
    assert len({c.lease.attempt_id for c in claimed}) == len({c.lease.token for c in claimed}) == 200
    tasks = (await store.list_tasks(limit=1000)).tasks
    lease_of = {c.task.id: c.lease.attempt_id for c in claimed}
    assert all(t.state is State.LEASED and [a.id for a in t.attempts] == [lease_of[t.id]] for t in tasks)
    assert await store.renew([c.lease for c in claimed], now=T0 + 2, lease_s=LEASE_S) == {}


async def test_claimed_task_reads_as_the_store_holds_it(store: Store) -> None:
    first = await running(store, max_attempts=3)
    assert await store.finish(first.lease, FAILED_RETRYABLE, now=T0, policy=POLICY) is State.RETRY_WAIT
    again = await claim_one(store, now=T0 + 60, worker=Worker("node-b", "b-1", "worker-9"))
    stored = await store.get(again.task.id)
    assert again.task == dataclasses.replace(stored, attempts=(), results=())
    assert (stored.state, stored.attempt, stored.node_id, stored.error) == (State.LEASED, 2, "node-b", None)
    assert [(a.number, a.node_id, a.worker_id, a.status) for a in stored.attempts] == [
        (1, "node-a", "worker-1", AttemptStatus.FAILED), (2, "node-b", "worker-9", AttemptStatus.LEASED)]


# worker writes are fenced by attempt id and lease token


@pytest.mark.parametrize("wrong", ["token", "attempt_id"])
async def test_worker_writes_with_a_stale_lease_are_rejected_and_change_nothing(
        store: Store, wrong: str) -> None:
    c = await running(store)
    await store.record_result(c.lease, result("kept"), now=T0)
    stale = dataclasses.replace(c.lease, **{wrong: "0" * 32})
    async with changes_nothing(store, c.task.id):
        lost = await store.renew([stale], now=T0 + 1, lease_s=LEASE_S)
        assert list(lost) == [stale.attempt_id] and isinstance(lost[stale.attempt_id], LeaseLost)
        lost = await store.set_phase([PhaseNote(stale, Phase.STOP, {"fraction": 1.0})], now=T0 + 1)
        assert list(lost) == [stale.attempt_id] and isinstance(lost[stale.attempt_id], LeaseLost)
        with pytest.raises(LeaseLost):
            await store.record_result(stale, result("stale"), now=T0 + 1)
        with pytest.raises(LeaseLost):
            await store.finish(stale, SUCCEEDED, now=T0 + 1, policy=POLICY)
    assert await store.renew([c.lease], now=T0 + 1, lease_s=LEASE_S) == {}  # the real holder is unharmed


async def test_lease_past_its_expiry_is_rejected_before_the_reconciler_runs(store: Store) -> None:
    c = await running(store)
    late = c.lease.expires_at + 1
    async with changes_nothing(store, c.task.id):
        assert list(await store.renew([c.lease], now=late, lease_s=LEASE_S)) == [c.lease.attempt_id]
        assert list(await store.set_phase([PhaseNote(c.lease, Phase.STOP)], now=late)) == [c.lease.attempt_id]
        with pytest.raises(LeaseLost):
            await store.record_result(c.lease, result(), now=late)
        with pytest.raises(LeaseLost):
            await store.finish(c.lease, SUCCEEDED, now=late, policy=POLICY)


async def test_renewed_lease_outlives_its_first_expiry(store: Store) -> None:
    c = await running(store)
    assert await store.renew([c.lease], now=c.lease.expires_at - 1, lease_s=LEASE_S) == {}
    assert await store.expire_leases(now=c.lease.expires_at + 1, policy=POLICY) == []
    state = await store.finish(c.lease, SUCCEEDED, now=c.lease.expires_at + 2, policy=POLICY)
    assert state is State.COMPLETED


# lease expiry and restart recovery (rules 4, 5)


async def test_expired_lease_retries_with_backoff_then_fails_when_attempts_run_out(store: Store) -> None:
    task = await add(store, max_attempts=3)
    now = T0
    for number in (1, 2, 3):
        c = await claim_one(store, now=now)
        assert c.task.attempt == number
        assert await store.expire_leases(now=c.lease.expires_at - 1, policy=POLICY) == []
        now = c.lease.expires_at + 1
        expired = await store.expire_leases(now=now, policy=POLICY)
        t = await store.get(task.id)
        assert [(e.task_id, e.attempt_id, e.state, e.type) for e in expired] == \
            [(task.id, c.lease.attempt_id, t.state, "noop")]
        assert (t.attempts[-1].status, t.error and t.error.code) == (AttemptStatus.EXPIRED, "lease_expired")
        with pytest.raises(LeaseLost):
            await store.finish(c.lease, SUCCEEDED, now=now, policy=POLICY)  # the worker comes back too late
        if number < 3:
            lo, hi = backoff_window(number, now)
            assert t.state is State.RETRY_WAIT and lo <= t.available_at <= hi
            assert await claim(store, now=t.available_at - 0.01) == []
            now = t.available_at
    assert (t.state, t.attempt, t.finished_at) == (State.FAILED, 3, now)
    assert await claim(store, now=now + 86400) == []


async def test_restart_recovery_ends_the_interruptions_a_shutdown_could_not_write_as_interruptions(
        store: Store) -> None:
    """The shutdown stopped these attempts while the store was away: charged as crashes, a task with
    max_attempts 1 would fail without ever having failed: an interruption is not charged."""
    old = Worker("node-a", "a-old", "worker-1")
    stopped = await running(store, worker=old, max_attempts=1)
    crashed = await running(store, worker=old, max_attempts=1)
    expired = await store.expire_leases(now=T0 + 1, policy=POLICY, node_id="node-a", keep_instance="a-new",
                                        interrupted=frozenset({stopped.lease.attempt_id}))
    assert {(e.task_id, e.state) for e in expired} == {(stopped.task.id, State.PENDING),
                                                       (crashed.task.id, State.FAILED)}
    t = await store.get(stopped.task.id)
    assert (t.attempt, t.interruptions, t.attempts[-1].status) == (0, 1, AttemptStatus.INTERRUPTED)
    assert (await store.get(crashed.task.id)).attempts[-1].status is AttemptStatus.EXPIRED


async def test_restart_recovery_expires_only_this_nodes_earlier_process_at_once(store: Store) -> None:
    old, new = Worker("node-a", "a-old", "worker-1"), Worker("node-a", "a-new", "worker-1")
    old_leased = await leased(store, worker=old, type="t1")
    old_running = await running(store, worker=old, type="t2")
    mine = await running(store, worker=new, type="t3")
    other = await running(store, worker=Worker("node-b", "b-1", "worker-1"), type="t4")
    expired = await store.expire_leases(now=T0 + 1, policy=POLICY, node_id="node-a", keep_instance="a-new")
    assert {(e.task_id, e.state, e.type) for e in expired} == {(old_leased.task.id, State.RETRY_WAIT, "t1"),
                                                                (old_running.task.id, State.RETRY_WAIT, "t2")}
    for c in (old_leased, old_running):
        assert (await store.get(c.task.id)).attempts[-1].status is AttemptStatus.EXPIRED
    assert await store.renew([mine.lease, other.lease], now=T0 + 1, lease_s=LEASE_S) == {}


# how attempts end


async def test_success_completes_the_task_and_keeps_the_attempts_output(store: Store) -> None:
    c = await running(store)
    done = Outcome(AttemptStatus.SUCCEEDED, stderr_tail="warning: slow host\n")
    assert await store.finish(c.lease, done, now=T0 + 5, policy=POLICY) is State.COMPLETED
    t = await store.get(c.task.id)
    assert (t.state, t.phase, t.error, t.finished_at, t.attempt) == (State.COMPLETED, None, None, T0 + 5, 1)
    a = t.attempts[0]
    assert (a.status, a.finished_at, a.stderr_tail) == \
        (AttemptStatus.SUCCEEDED, T0 + 5, "warning: slow host\n")
    with pytest.raises(LeaseLost):
        await store.finish(c.lease, SUCCEEDED, now=T0 + 6, policy=POLICY)  # an attempt ends once


async def test_illegal_finish_raises_invalid_transition_and_changes_nothing(store: Store) -> None:
    c = await running(store)
    async with changes_nothing(store, c.task.id):
        with pytest.raises(InvalidTransition):
            await store.finish(c.lease, CANCELLED, now=T0 + 1, policy=POLICY)  # nobody asked to cancel
    assert await store.finish(c.lease, SUCCEEDED, now=T0 + 2, policy=POLICY) is State.COMPLETED


async def test_finish_many_gives_each_ending_what_finish_alone_would(store: Store) -> None:
    done = [await running(store, type=f"done-{i}") for i in range(3)]
    retry, last = await running(store, type="retry", max_attempts=2), await running(store, type="last", max_attempts=1)
    slow, stale, cancelled = [await running(store, type=t) for t in ("slow", "stale", "cancelled")]
    interrupted, illegal, noisy = [await running(store, type=t) for t in ("interrupted", "illegal", "noisy")]
    assert (await store.request_cancel(cancelled.task.id, now=T0 + 1)).state is State.CANCELLING
    with_output = Outcome(AttemptStatus.SUCCEEDED, exit_status=0, stderr_tail="warning: slow host\n")
    endings = [
        Ending(done[0].lease, SUCCEEDED, T0 + 2),
        Ending(retry.lease, FAILED_RETRYABLE, T0 + 3),
        Ending(dataclasses.replace(stale.lease, token="0" * 32), SUCCEEDED, T0 + 4),
        Ending(done[1].lease, SUCCEEDED, T0 + 5),
        Ending(last.lease, FAILED_RETRYABLE, T0 + 6),
        Ending(cancelled.lease, SUCCEEDED, T0 + 7),         # the cancel wins, as with finish()
        Ending(slow.lease, TIMED_OUT, T0 + 8),
        Ending(illegal.lease, CANCELLED, T0 + 9),           # nobody asked to cancel
        Ending(interrupted.lease, INTERRUPTED, T0 + 10),
        Ending(noisy.lease, with_output, T0 + 11),
        Ending(done[0].lease, FAILED_RETRYABLE, T0 + 12),   # an attempt ends once, within one call too
        Ending(done[2].lease, SUCCEEDED, T0 + 13),
    ]
    answers = await store.finish_many(endings, policy=POLICY)
    assert [type(a) if isinstance(a, Exception) else a for a in answers] == [
        State.COMPLETED, State.RETRY_WAIT, LeaseLost, State.COMPLETED, State.FAILED, State.CANCELLED,
        State.TIMED_OUT, InvalidTransition, State.PENDING, State.COMPLETED, LeaseLost, State.COMPLETED]
    ended = [(c, await store.get(c.task.id)) for c in (*done, retry, last, slow, cancelled, interrupted, noisy)]
    assert [(t.state, t.finished_at, t.attempts[0].status, t.attempts[0].finished_at) for _, t in ended] == [
        (State.COMPLETED, T0 + 2, AttemptStatus.SUCCEEDED, T0 + 2),
        (State.COMPLETED, T0 + 5, AttemptStatus.SUCCEEDED, T0 + 5),
        (State.COMPLETED, T0 + 13, AttemptStatus.SUCCEEDED, T0 + 13),
        (State.RETRY_WAIT, None, AttemptStatus.FAILED, T0 + 3),
        (State.FAILED, T0 + 6, AttemptStatus.FAILED, T0 + 6),
        (State.TIMED_OUT, T0 + 8, AttemptStatus.TIMED_OUT, T0 + 8),
        (State.CANCELLED, T0 + 7, AttemptStatus.CANCELLED, T0 + 7),
        (State.PENDING, None, AttemptStatus.INTERRUPTED, T0 + 10),
        (State.COMPLETED, T0 + 11, AttemptStatus.SUCCEEDED, T0 + 11),
    ]
    t = ended[-1][1]
    assert (t.attempts[0].exit_status, t.attempts[0].stderr_tail) == (0, "warning: slow host\n")
    assert (await store.get(interrupted.task.id)).attempt == 0  # given back, as finish() does
    for c in (stale, illegal):  # refused: untouched, and the real holders are unharmed
        t = await store.get(c.task.id)
        assert (t.state, t.attempts[0].status, t.attempts[0].finished_at) == \
            (State.RUNNING, AttemptStatus.RUNNING, None)
    assert await store.renew([stale.lease, illegal.lease], now=T0 + 14, lease_s=LEASE_S) == {}


async def test_finish_many_judges_each_lease_at_its_own_time(store: Store) -> None:
    early, expired, late = [await running(store, type=t) for t in ("early", "expired", "late")]
    assert await store.renew([late.lease], now=T0 + 20, lease_s=LEASE_S) == {}  # good until T0 + 50
    endings = [Ending(early.lease, SUCCEEDED, T0 + 5),
               Ending(expired.lease, SUCCEEDED, expired.lease.expires_at + 1),
               Ending(late.lease, SUCCEEDED, T0 + 40)]
    async with changes_nothing(store, expired.task.id):
        answers = await store.finish_many(endings, policy=POLICY)
    assert [answers[0], type(answers[1]), answers[2]] == [State.COMPLETED, LeaseLost, State.COMPLETED]
    ended = [await store.get(c.task.id) for c in (early, late)]
    assert [(t.finished_at, t.attempts[0].finished_at) for t in ended] == [(T0 + 5, T0 + 5), (T0 + 40, T0 + 40)]


async def test_finish_many_of_nothing_is_nothing(store: Store) -> None:
    assert await store.finish_many([], policy=POLICY) == []


async def test_retryable_failure_with_attempts_left_waits_for_backoff(store: Store) -> None:
    c = await running(store, max_attempts=2)
    assert await store.finish(c.lease, FAILED_RETRYABLE, now=T0 + 5, policy=POLICY) is State.RETRY_WAIT
    t = await store.get(c.task.id)
    lo, hi = backoff_window(1, T0 + 5)
    assert t.state is State.RETRY_WAIT and t.finished_at is None and lo <= t.available_at <= hi
    assert (t.error and t.error.code, t.attempts[0].status) == ("boom", AttemptStatus.FAILED)
    assert (t.attempts[0].exit_status, t.attempts[0].stderr_tail) == (1, "boom\n")
    again = await claim_one(store, now=t.available_at)
    assert await store.finish(again.lease, FAILED_RETRYABLE, now=t.available_at + 1, policy=POLICY) \
        is State.FAILED


async def test_non_retryable_failure_fails_at_once(store: Store) -> None:
    c = await running(store, max_attempts=3)
    assert await store.finish(c.lease, FAILED_FOR_GOOD, now=T0 + 5, policy=POLICY) is State.FAILED
    t = await store.get(c.task.id)
    assert (t.state, t.attempt, t.finished_at, t.error and t.error.code) == \
        (State.FAILED, 1, T0 + 5, "invalid_argument")


async def test_timeout_ends_timed_out_unless_the_type_retries_timeouts(store: Store) -> None:
    c = await running(store, type="strict")
    assert await store.finish(c.lease, TIMED_OUT, now=T0 + 5, policy=POLICY) is State.TIMED_OUT
    t = await store.get(c.task.id)
    assert (t.state, t.attempts[0].status, t.finished_at) == \
        (State.TIMED_OUT, AttemptStatus.TIMED_OUT, T0 + 5)
    lenient = await running(store, type="lenient")
    retry_on_timeout = dataclasses.replace(TIMED_OUT, error=TaskError("timeout", "timed out", True))
    assert await store.finish(lenient.lease, retry_on_timeout, now=T0 + 5, policy=POLICY) is State.RETRY_WAIT


async def test_interruption_gives_the_attempt_back_until_max_interruptions(store: Store) -> None:
    task = await add(store, max_attempts=1)
    for n in (1, 2):
        c = await claim_one(store, now=T0 + n)
        assert c.task.attempt == 1
        assert await store.finish(c.lease, INTERRUPTED, now=T0 + n, policy=POLICY) is State.PENDING
        t = await store.get(task.id)
        assert (t.attempt, t.interruptions, t.available_at, t.finished_at) == (0, n, T0 + n, None)
        assert (t.attempts[-1].number, t.attempts[-1].status) == (n, AttemptStatus.INTERRUPTED)
    c = await claim_one(store, now=T0 + 3)  # one interruption more than retry.max_interruptions (2)
    assert await store.finish(c.lease, INTERRUPTED, now=T0 + 3, policy=POLICY) is State.FAILED
    t = await store.get(task.id)
    assert (t.state, t.error and t.error.code, t.finished_at) == (State.FAILED, "interrupted", T0 + 3)
    assert [a.number for a in t.attempts] == [1, 2, 3]


async def test_promote_due_moves_only_due_retry_waits_to_pending(store: Store) -> None:
    early = await running(store, type="early")
    late = await running(store, type="late")
    await store.finish(early.lease, FAILED_RETRYABLE, now=T0 + 1, policy=POLICY)   # due ~T0+3
    await store.finish(late.lease, FAILED_RETRYABLE, now=T0 + 20, policy=POLICY)   # due ~T0+22
    assert await store.promote_due(now=T0 + 10) == 1
    assert [(await store.get(c.task.id)).state for c in (early, late)] == [State.PENDING, State.RETRY_WAIT]
    assert await store.promote_due(now=T0 + 30) == 1
    assert await store.promote_due(now=T0 + 40) == 0
    assert (await store.get(late.task.id)).state is State.PENDING


# cancel: queued tasks end at once, held ones are asked to stop; a repeated cancel changes nothing


@pytest.mark.parametrize("state", [State.PENDING, State.RETRY_WAIT])
async def test_cancel_of_a_queued_task_ends_it_at_once(store: Store, state: State) -> None:
    task = await task_in(store, state)
    assert (await store.request_cancel(task.id, now=T0 + 7)).state is State.CANCELLED
    t = await store.get(task.id)
    assert t.error is not None
    assert (t.state, t.finished_at, t.error.to_json()) == (State.CANCELLED, T0 + 7, CANCELLED_ON_REQUEST.to_json())
    assert await claim(store, now=T0 + 86400) == []


@pytest.mark.parametrize("held", [State.LEASED, State.RUNNING])
@pytest.mark.parametrize("reported", [CANCELLED, SUCCEEDED], ids=["worker-cancelled", "worker-succeeded"])
async def test_cancel_of_a_held_task_waits_for_its_worker(
        store: Store, held: State, reported: Outcome) -> None:
    c = await (leased if held is State.LEASED else running)(store)
    assert (await store.request_cancel(c.task.id, now=T0 + 1)).state is State.CANCELLING
    async with changes_nothing(store, c.task.id):
        lost = await store.renew([c.lease], now=T0 + 2, lease_s=LEASE_S)
        assert isinstance(lost[c.lease.attempt_id], TaskCancelling)
        lost = await store.set_phase([PhaseNote(c.lease, Phase.RUN, {"fraction": 0.5})], now=T0 + 2)
        assert isinstance(lost[c.lease.attempt_id], TaskCancelling)
        with pytest.raises(TaskCancelling):
            await store.record_result(c.lease, result(), now=T0 + 2)
        assert await claim(store, now=T0 + 2) == []
    assert await store.finish(c.lease, reported, now=T0 + 3, policy=POLICY) is State.CANCELLED
    t = await store.get(c.task.id)
    assert (t.state, t.finished_at, t.attempts[0].status) == \
        (State.CANCELLED, T0 + 3, AttemptStatus.CANCELLED)
    assert t.results == ()


async def test_cancelling_task_whose_worker_died_ends_cancelled_at_lease_expiry(store: Store) -> None:
    c = await running(store)
    await store.request_cancel(c.task.id, now=T0 + 1)
    expired = await store.expire_leases(now=c.lease.expires_at + 1, policy=POLICY)
    assert [(e.task_id, e.state) for e in expired] == [(c.task.id, State.CANCELLED)]
    assert (await store.get(c.task.id)).state is State.CANCELLED


@pytest.mark.parametrize("state", [State.CANCELLING, State.CANCELLED])
async def test_repeated_cancel_is_a_no_op(store: Store, state: State) -> None:
    task = await task_in(store, state)
    async with changes_nothing(store, task.id):
        assert await store.request_cancel(task.id, now=T0 + 9) == CancelAnswer(state, False, task.type)


@pytest.mark.parametrize("state", [State.COMPLETED, State.FAILED, State.TIMED_OUT])
async def test_cancel_of_an_ended_task_is_a_conflict(store: Store, state: State) -> None:
    task = await task_in(store, state)
    async with changes_nothing(store, task.id):
        with pytest.raises(Conflict):
            await store.request_cancel(task.id, now=T0 + 9)


async def test_finish_cancels_ends_only_cancels_past_the_deadline(store: Store) -> None:
    stuck = await running(store, type="stuck")
    young = await running(store, type="young")
    await store.request_cancel(stuck.task.id, now=T0 + 1)
    await store.request_cancel(young.task.id, now=T0 + 30)
    assert await store.finish_cancels(now=T0 + 62, deadline_s=60.0) == [Ended(stuck.task.id, "stuck")]
    t = await store.get(stuck.task.id)
    assert (t.state, t.finished_at, t.attempts[0].status) == \
        (State.CANCELLED, T0 + 62, AttemptStatus.CANCELLED)
    assert t.error is not None and t.attempts[0].error is not None  # the task says why, as its attempt does
    assert t.error.to_json() == t.attempts[0].error.to_json() == cancel_deadline_error(60.0).to_json()
    assert (await store.get(young.task.id)).state is State.CANCELLING
    with pytest.raises(LeaseLost):
        await store.finish(stuck.lease, CANCELLED, now=T0 + 63, policy=POLICY)  # too late to answer
    assert await store.finish(young.lease, CANCELLED, now=T0 + 63, policy=POLICY) is State.CANCELLED


# unserviceable tags: queued tasks no node of the fleet can serve fail


X, XY, Y = frozenset({"x"}), frozenset({"x", "y"}), frozenset({"y"})


async def test_unserviceable_fails_only_queued_tasks_with_exactly_those_tags(store: Store) -> None:
    with_x = {state: await task_in(store, state, required_tags=("x",)) for state in State}
    others = [(await add(store, type="other", required_tags=tags)).id for tags in (("x", "y"), ("y",), ())]
    assert sorted(map(sorted, await store.queued_tag_sets())) == [["x"], ["x", "y"], ["y"]]
    queued = {with_x[State.PENDING].id, with_x[State.RETRY_WAIT].id}
    untouched = [t.id for t in with_x.values() if t.id not in queued] + others
    async with changes_nothing(store, *untouched):
        failed = await store.fail_unserviceable(X, now=T0 + 5, message="no live node has tags ['x']")
    assert set(failed) == {Ended(t.id, t.type) for t in (with_x[State.PENDING], with_x[State.RETRY_WAIT])}
    for task_id in queued:
        t = await store.get(task_id)
        assert t.error is not None
        assert (t.state, t.error.code, t.error.message, t.finished_at, t.updated_at, t.phase) == \
            (State.FAILED, "unserviceable", "no live node has tags ['x']", T0 + 5, T0 + 5, None)
    assert await store.fail_unserviceable(X, now=T0 + 6, message="again") == []
    assert sorted(map(sorted, await store.queued_tag_sets())) == [["x", "y"], ["y"]]


async def test_two_nodes_failing_the_same_tags_at_once_fail_each_task_once(store: Store) -> None:
    added = await store.add_many([NewTask("noop", {"n": n}, required_tags=("gpu",)) for n in range(300)], now=T0)
    ids = [task_id for task_id, _ in added]
    both = await asyncio.gather(*(store.fail_unserviceable(frozenset({"gpu"}), now=T0 + 1, message="gone")
                                  for _ in range(2)))
    assert Counter(e.task_id for e in both[0] + both[1]) == Counter(ids)
    assert await store.queued_tag_sets() == []


# results: each batch stored once, under its idempotency key


async def test_result_batch_is_stored_once_per_key(store: Store) -> None:
    c = await running(store, max_attempts=2)
    sent = result("r1", {"open": [22]})
    first = dataclasses.replace(sent, attempt_id=c.lease.attempt_id)  # stored with the attempt that sent it
    assert await store.record_result(c.lease, sent, now=T0 + 1) == first
    assert await store.record_result(c.lease, dataclasses.replace(sent, sequence=7), now=T0 + 2) == first
    async with changes_nothing(store, c.task.id):
        with pytest.raises(Conflict):
            await store.record_result(c.lease, result("r1", {"open": [23]}), now=T0 + 3)
    # the next attempt of an at-least-once task sends the same batch again
    await store.expire_leases(now=c.lease.expires_at + 1, policy=POLICY)
    again = await claim_one(store, now=T0 + 3600)
    assert await store.record_result(again.lease, sent, now=T0 + 3600) == first, "acknowledged as the first's"
    second = dataclasses.replace(result("r2", {"open": []}, sequence=1), attempt_id=again.lease.attempt_id)
    assert await store.record_result(again.lease, second, now=T0 + 3601) == second
    assert (await store.get(c.task.id)).results == (first, second)
    listed = (await store.list_tasks()).tasks[0]
    assert (listed.id, listed.results, len(listed.attempts)) == (c.task.id, (), 2)  # lists carry no results


# the retry API


@pytest.mark.parametrize("state", [State.FAILED, State.TIMED_OUT, State.CANCELLED])
async def test_retry_gives_an_ended_task_a_fresh_budget(store: Store, state: State) -> None:
    ended = await task_in(store, state)
    task = await store.retry(ended.id, now=T0 + 100)
    assert (task.state, task.attempt, task.max_attempts, task.interruptions) == \
        (State.PENDING, 0, ended.max_attempts, 0)
    assert (task.error, task.finished_at, task.available_at) == (None, None, T0 + 100)
    assert task.attempts == (await store.get(ended.id)).attempts  # the answer shows the task as it is
    c = await claim_one(store, now=T0 + 100)
    assert (c.task.id, c.task.attempt) == (ended.id, 1)
    numbers = [a.number for a in (await store.get(ended.id)).attempts]
    assert numbers == list(range(1, len(numbers) + 1))


async def test_a_retried_task_shows_no_progress_of_its_last_attempt(store: Store) -> None:
    c = await running(store)
    assert await store.set_phase([PhaseNote(c.lease, Phase.RUN, {"fraction": 0.1, "message": "10%"})],
                                 now=T0 + 1) == {}
    failing = Outcome(AttemptStatus.FAILED, TaskError("boom", "no", retryable=False))
    assert await store.finish(c.lease, failing, now=T0 + 2, policy=POLICY) is State.FAILED
    assert (await store.get(c.task.id)).progress is not None
    assert (await store.retry(c.task.id, now=T0 + 3)).progress is None
    assert (await store.get(c.task.id)).progress is None


@pytest.mark.parametrize("state", [State.PENDING, State.LEASED, State.RUNNING, State.RETRY_WAIT,
                                   State.CANCELLING, State.COMPLETED])
async def test_retry_of_an_unended_or_completed_task_is_a_conflict(store: Store, state: State) -> None:
    task = await task_in(store, state)
    async with changes_nothing(store, task.id):
        with pytest.raises(Conflict):
            await store.retry(task.id, now=T0 + 100)


async def test_retry_into_a_full_queue_raises_queue_full_and_changes_nothing(store: Store) -> None:
    """A retry queues a task as a submit does: past pool.max_queued it is refused the same way."""
    ended = await task_in(store, State.FAILED)
    await add(store)
    async with changes_nothing(store, ended.id):
        with pytest.raises(QueueFull):
            await store.retry(ended.id, now=T0 + 100, max_queued=1)
    assert (await store.retry(ended.id, now=T0 + 100, max_queued=2)).state is State.PENDING


# prune, phases


async def test_record_result_says_whether_it_stored_the_batch_or_found_it_stored(store: Store) -> None:
    c = await running(store)
    stored = await store.record_result(c.lease, result("r1"), now=T0 + 1)
    found = await store.record_result(c.lease, result("r1"), now=T0 + 2)  # its answer was lost: sent again
    assert (stored, stored.stored_now, found.stored_now) == (found, True, False)


async def test_prune_deletes_old_ended_tasks_with_their_attempts_and_results(store: Store) -> None:
    old = await running(store, type="old", idempotency_key="k-old")
    await store.record_result(old.lease, result("r-old"), now=T0)
    await store.finish(old.lease, SUCCEEDED, now=T0 + 1, policy=POLICY)
    recent = await running(store, type="recent", now=T0 + 90)
    await store.finish(recent.lease, FAILED_FOR_GOOD, now=T0 + 100, policy=POLICY)
    waiting = await add(store, type="waiting")
    busy = await running(store, type="busy", now=T0 + 90)
    assert await store.prune(before=T0 + 50) == 1
    with pytest.raises(TaskNotFound):
        await store.get(old.task.id)
    kept = {t.id for t in (await store.list_tasks()).tasks}
    assert kept == {recent.task.id, waiting.id, busy.task.id}
    # the key and the result key died with the task
    await add(store, type="old", payload={"new": True}, idempotency_key="k-old")
    other = result("r-old", {"another": "payload"})
    stored = await store.record_result(busy.lease, other, now=T0 + 101)
    assert stored == dataclasses.replace(other, attempt_id=busy.lease.attempt_id)


async def test_first_phase_note_starts_the_task_and_records_progress(store: Store) -> None:
    a, b = await leased(store, type="a"), await leased(store, type="b")
    assert (await store.get(a.task.id)).attempts[0].status is AttemptStatus.LEASED
    notes = [PhaseNote(a.lease, Phase.INITIALIZE), PhaseNote(b.lease, Phase.PREPARE, {"fraction": 0.1})]
    assert await store.set_phase(notes, now=T0 + 1) == {}
    ta, tb = await store.get(a.task.id), await store.get(b.task.id)
    assert (ta.state, ta.phase, ta.progress, ta.updated_at) == (State.RUNNING, Phase.INITIALIZE, None, T0 + 1)
    assert (tb.state, tb.phase, tb.progress) == (State.RUNNING, Phase.PREPARE, {"fraction": 0.1})
    assert ta.attempts[0].status is AttemptStatus.RUNNING
    progress = {"fraction": 0.4, "message": "port 80 open"}
    await store.set_phase([PhaseNote(a.lease, Phase.RUN, progress)], now=T0 + 2)
    await store.set_phase([PhaseNote(a.lease, Phase.STOP)], now=T0 + 3)  # no progress: keep the last
    ta = await store.get(a.task.id)
    assert (ta.phase, ta.progress, ta.attempts[0].status) == (Phase.STOP, progress, AttemptStatus.RUNNING)


async def test_an_ending_writes_the_attempts_last_progress_else_keeps_the_flushed_one(store: Store) -> None:
    """The lease keeper writes notes behind, so an attempt's last report may reach the store only with
    its end: a completed task must not show the progress of some earlier flush."""
    flushed, final = {"fraction": 0.5, "message": "half"}, {"fraction": 1.0, "message": "all"}
    grouped, alone, silent, single = [await running(store, type=t) for t in ("grouped", "alone", "silent", "single")]
    for c in (grouped, alone, silent, single):
        assert await store.set_phase([PhaseNote(c.lease, Phase.RUN, flushed)], now=T0 + 1) == {}
    failed = Outcome(AttemptStatus.FAILED, TaskError("boom", "the plugin broke", True), progress=final)
    endings = [Ending(grouped.lease, Outcome(AttemptStatus.SUCCEEDED, progress=final), T0 + 2),  # completed together
               Ending(alone.lease, failed, T0 + 2),  # each on its own path
               Ending(silent.lease, Outcome(AttemptStatus.SUCCEEDED), T0 + 2)]  # nothing new to say
    assert await store.finish_many(endings, policy=POLICY) == [State.COMPLETED, State.RETRY_WAIT, State.COMPLETED]
    assert await store.finish(single.lease, Outcome(AttemptStatus.SUCCEEDED, progress=final), now=T0 + 2,
                              policy=POLICY) is State.COMPLETED
    progress = [(await store.get(c.task.id)).progress for c in (grouped, alone, silent, single)]
    assert progress == [final, final, flushed, final]



async def test_phase_notes_written_together_refuse_only_the_lost_and_the_cancelled(store: Store) -> None:
    live, stolen, cancelled = [await running(store, type=t) for t in ("live", "stolen", "cancelled")]
    stale = dataclasses.replace(stolen.lease, token="0" * 32)
    assert (await store.request_cancel(cancelled.task.id, now=T0 + 1)).state is State.CANCELLING
    notes = [PhaseNote(live.lease, Phase.STOP, {"fraction": 1.0}), PhaseNote(stale, Phase.STOP),
             PhaseNote(cancelled.lease, Phase.STOP)]
    async with changes_nothing(store, stolen.task.id, cancelled.task.id):
        lost = await store.set_phase(notes, now=T0 + 2)
    assert set(lost) == {stale.attempt_id, cancelled.lease.attempt_id}
    assert type(lost[stale.attempt_id]) is LeaseLost and isinstance(lost[cancelled.lease.attempt_id], TaskCancelling)
    t = await store.get(live.task.id)
    assert (t.state, t.phase, t.progress, t.updated_at) == (State.RUNNING, Phase.STOP, {"fraction": 1.0}, T0 + 2)

# SQLite only


@contextlib.contextmanager
def writer_lock_held(path: Path) -> Iterator[None]:
    """Hold the database's write lock from outside: ops queued meanwhile share one transaction."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
        conn.execute("COMMIT")
    finally:
        conn.close()


async def in_one_transaction(store: Store, *ops: Awaitable[Any]) -> list[Any]:
    assert isinstance(store, SqliteStore)
    with writer_lock_held(store.path):
        gathered = asyncio.gather(store.promote_due(now=T0), *ops, return_exceptions=True)
        await anyio.wait_all_tasks_blocked()  # every op is queued behind the lock
    return list(await gathered)[1:]  # the first op may go alone; the rest queue up together


@sqlite_only
async def test_committed_writes_survive_close_and_reopen(store: Store) -> None:
    assert isinstance(store, SqliteStore)
    c = await running(store, idempotency_key="k", payload={"target": "a"})
    await store.record_result(c.lease, result(), now=T0 + 1)
    waiting = await add(store, type="waiting", now=T0 + 2)
    before = [await store.get(i) for i in (c.task.id, waiting.id)]
    await store.close()
    reopened = SqliteStore(store.path)
    await reopened.open(migrate=False)
    try:
        assert [await reopened.get(i) for i in (c.task.id, waiting.id)] == before
        _, created = await reopened.add(NewTask("noop", {"target": "a"}, idempotency_key="k"), now=T0 + 3)
        assert not created
        assert await reopened.renew([c.lease], now=T0 + 3, lease_s=LEASE_S) == {}
    finally:
        await reopened.close()


@sqlite_only
async def test_prune_leaves_no_attempt_or_result_rows_behind(store: Store) -> None:
    assert isinstance(store, SqliteStore)
    for now in (T0, T0 + 100):
        c = await running(store, now=now, type=f"at-{now}")
        await store.record_result(c.lease, result(f"r-{now}"), now=now)
        await store.finish(c.lease, SUCCEEDED, now=now, policy=POLICY)
    assert await store.prune(before=T0 + 50) == 1
    with contextlib.closing(sqlite3.connect(store.path)) as db:
        rows = [db.execute(f"SELECT count(*) FROM {t} WHERE task_id NOT IN (SELECT id FROM tasks)").fetchone()[0]
                for t in ("attempts", "results")]
        kept = [db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("attempts", "results")]
    assert (rows, kept) == ([0, 0], [1, 1])


@sqlite_only
async def test_refused_op_does_not_fail_the_ops_that_share_its_transaction(store: Store) -> None:
    c = await running(store, type="held")
    await add(store, idempotency_key="k", payload={"v": 1})
    async with changes_nothing(store, c.task.id):
        outcomes = await in_one_transaction(
            store,
            store.add(NewTask("noop", {"n": 1}), now=T0),
            store.add(NewTask("noop", {"v": 2}, idempotency_key="k"), now=T0),  # Conflict
            store.add(NewTask("noop", {"n": 2}), now=T0),
            store.finish(c.lease, CANCELLED, now=T0, policy=POLICY),  # InvalidTransition: nobody cancelled
            store.add(NewTask("noop", {"n": 3}), now=T0),
        )
    assert isinstance(outcomes[1], Conflict) and isinstance(outcomes[3], InvalidTransition)
    for i, n in ((0, 1), (2, 2), (4, 3)):
        task, created = outcomes[i]
        assert created and (await store.get(task.id)).payload == {"n": n}


@sqlite_only
async def test_ops_in_one_transaction_see_each_others_queue_count(store: Store) -> None:
    await add(store)
    ended = await task_in(store, State.FAILED)
    outcomes = await in_one_transaction(
        store,
        store.add(NewTask("noop"), now=T0, max_queued=3),  # 2 queued
        store.retry(ended.id, now=T0),                     # 3 queued
        store.add(NewTask("noop"), now=T0, max_queued=3),  # would be 4
    )
    assert isinstance(outcomes[2], QueueFull)
    assert (await store.counts()).get(State.PENDING) == 3


@sqlite_only
async def test_unserviceable_tasks_leave_room_in_the_queue_within_one_transaction(store: Store) -> None:
    await add(store, required_tags=("x",))
    await add(store)
    outcomes = await in_one_transaction(
        store,
        store.add(NewTask("noop"), now=T0, max_queued=3),     # 3 queued
        store.fail_unserviceable(X, now=T0, message="gone"),  # 2 queued
        store.add(NewTask("noop"), now=T0, max_queued=3),     # 3 queued again: room
    )
    assert not [o for o in outcomes if isinstance(o, Exception)]
    assert (await store.counts()).get(State.PENDING) == 3


@sqlite_only
async def test_writer_keeps_serving_after_a_write_fails(store: Store) -> None:
    with pytest.raises((StoreError, TypeError)):
        await store.add(NewTask("noop", {"when": datetime.now(UTC)}), now=T0)  # not JSON
    assert (await add(store, now=T0 + 1)).state is State.PENDING


@sqlite_only
async def test_finish_many_is_one_transaction_whose_successes_share_their_statements(
        adapter: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(adapter, SqliteStore)
    statements: list[str] = []
    connect = adapter._db.connect_writer

    def traced(migrate: bool) -> tuple[sqlite3.Connection, int]:  # the writer's connection
        conn, version = connect(migrate)
        conn.set_trace_callback(statements.append)
        return conn, version

    monkeypatch.setattr(adapter._db, "connect_writer", traced)
    await adapter.open()
    try:
        await adapter.add_many([NewTask("noop") for _ in range(200)], now=T0)
        claimed = await claim(adapter, limit=200)
        endings = [Ending(c.lease, SUCCEEDED, T0 + 1 + i / 1000) for i, c in enumerate(claimed)]
        endings[7] = Ending(claimed[7].lease, FAILED_RETRYABLE, T0 + 2)
        endings[9] = Ending(dataclasses.replace(claimed[9].lease, token="0" * 32), SUCCEEDED, T0 + 2)
        statements.clear()
        answers = await adapter.finish_many(endings, policy=POLICY)
        transactions = [s for s in statements if s.startswith(("BEGIN", "COMMIT")) or s == "ROLLBACK"]
        assert transactions == ["BEGIN IMMEDIATE", "COMMIT"]
        assert len(statements) < 20, "198 successes share a few statements, not one or more each"
        expected: list[Any] = [State.COMPLETED] * 200
        expected[7], expected[9] = State.RETRY_WAIT, LeaseLost
        assert [type(a) if isinstance(a, Exception) else a for a in answers] == expected
        with contextlib.closing(sqlite3.connect(adapter.path)) as db:
            succeeded = dict(db.execute("SELECT id, finished_at FROM attempts WHERE status = 'succeeded'").fetchall())
        assert succeeded == {e.lease.attempt_id: e.now for i, e in enumerate(endings) if i not in (7, 9)}
    finally:
        await adapter.close()


@sqlite_only
async def test_finish_many_calls_that_share_a_transaction_get_their_own_answers(store: Store) -> None:
    a, b, c, d = [await running(store, type=t) for t in ("a", "b", "c", "d")]
    stale = dataclasses.replace(b.lease, token="0" * 32)
    outcomes = await in_one_transaction(
        store,
        store.finish_many([Ending(a.lease, SUCCEEDED, T0 + 1), Ending(stale, SUCCEEDED, T0 + 1)], policy=POLICY),
        store.finish(c.lease, SUCCEEDED, now=T0 + 2, policy=POLICY),
        store.finish_many([Ending(b.lease, FAILED_FOR_GOOD, T0 + 3), Ending(a.lease, SUCCEEDED, T0 + 3)],
                          policy=POLICY),
        store.finish(d.lease, CANCELLED, now=T0 + 4, policy=POLICY),  # InvalidTransition: nobody cancelled
    )
    first, second = outcomes[0], outcomes[2]
    assert [first[0], type(first[1])] == [State.COMPLETED, LeaseLost]
    assert outcomes[1] is State.COMPLETED
    assert [second[0], type(second[1])] == [State.FAILED, LeaseLost]  # a's attempt ended in the first call
    assert isinstance(outcomes[3], InvalidTransition)
    assert [(await store.get(x.task.id)).finished_at for x in (a, b, c)] == [T0 + 1, T0 + 3, T0 + 2]


@sqlite_only
async def test_an_ending_sqlite_refuses_fails_alone(store: Store) -> None:
    a, b, c = [await running(store, type=t) for t in ("a", "b", "c")]
    unbindable = Outcome(AttemptStatus.FAILED, TaskError("boom", "broke"), stderr_tail=object())  # type: ignore[arg-type]
    endings = [Ending(a.lease, SUCCEEDED, T0 + 1), Ending(b.lease, unbindable, T0 + 1),
               Ending(c.lease, FAILED_FOR_GOOD, T0 + 1)]
    async with changes_nothing(store, b.task.id):
        answers = await store.finish_many(endings, policy=POLICY)
    assert [answers[0], type(answers[1]), answers[2]] == [State.COMPLETED, StoreUnavailable, State.FAILED]
    assert await store.finish(b.lease, FAILED_FOR_GOOD, now=T0 + 2, policy=POLICY) is State.FAILED
