"""The outcome writer on a real SQLite store: outcomes posted together share a write, each gets its own
answer, a store that is briefly away is tried again, and flushed() means written."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import anyio

from tidepool.backoff import Backoff
from tidepool.errors import LeaseLost, StoreUnavailable, TidepoolError
from tidepool.execution.leases import Held
from tidepool.execution.outcomes import OutcomeWriter, Posted, UnwrittenInterruptions
from tidepool.lifecycle import RetryPolicy
from tidepool.model import AttemptStatus, Claimed, ClaimFilter, NewTask, Outcome, State, TaskError, Worker
from tidepool.store import Ending
from tidepool.store.sqlite import SqliteStore

POLICY = RetryPolicy(base_s=0.0, jitter=0.0)
WORKER = Worker("test-node", "i1", "test-node/w1")


class Flaky:
    """The real store behind a switch: while `away`, every write fails as a lost connection would."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self.away = 0
        self.calls: list[int] = []

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        self.calls.append(len(endings))
        if self.away:
            self.away -= 1
            raise StoreUnavailable("connection refused")
        return await self.store.finish_many(endings, policy=policy)


async def claimed(store: SqliteStore, n: int) -> list[Claimed]:
    now = time.time()
    await store.add_many([NewTask("noop", max_attempts=2)] * n, now=now)
    return await store.claim(WORKER, ClaimFilter(), limit=n, now=now, lease_s=30.0)


def posted(c: Claimed, outcome: Outcome) -> Posted:
    return Posted(c.task, Held(c.lease, anyio.CancelScope(), time.monotonic() + 30), outcome, WORKER.worker_id,
                  time.time())


async def test_outcomes_posted_together_share_one_write_and_each_gets_its_answer(store: SqliteStore) -> None:
    flaky = Flaky(store)
    answers: dict[str, State | TidepoolError] = {}
    writer = OutcomeWriter(flaky, policy=lambda: POLICY,  # type: ignore[arg-type]
                           report=lambda p, a: answers.__setitem__(p.task.id, a))
    tasks = await claimed(store, 30)
    stale = tasks[-1]
    stale_lease = stale.lease.__class__(stale.lease.task_id, stale.lease.attempt_id, "not-the-token",
                                        stale.lease.expires_at)
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run)
        for c in tasks[:20]:
            writer.post(posted(c, Outcome(AttemptStatus.SUCCEEDED)))
        for c in tasks[20:29]:
            writer.post(posted(c, Outcome(AttemptStatus.FAILED, TaskError("boom", "it broke"))))
        writer.post(posted(Claimed(stale.task, stale_lease), Outcome(AttemptStatus.SUCCEEDED)))
        await writer.flushed()
        tg.cancel_scope.cancel()

    assert flaky.calls == [30], "outcomes posted before the writer ran must share one write"
    assert [answers[c.task.id] for c in tasks[:20]] == [State.COMPLETED] * 20
    assert [answers[c.task.id] for c in tasks[20:29]] == [State.RETRY_WAIT] * 9
    assert isinstance(answers[stale.task.id], LeaseLost)
    assert (await store.get(tasks[0].task.id)).state is State.COMPLETED
    assert (await store.get(stale.task.id)).state is State.LEASED, "a refused outcome changes nothing"


async def test_a_store_briefly_away_is_tried_again_and_flushed_means_written(store: SqliteStore) -> None:
    flaky = Flaky(store)
    flaky.away = 2
    answers: dict[str, State | TidepoolError] = {}
    writer = OutcomeWriter(flaky, policy=lambda: POLICY,  # type: ignore[arg-type]
                           report=lambda p, a: answers.__setitem__(p.task.id, a), retry=Backoff(0.01, 0.01, tries=3))
    tasks = await claimed(store, 3)
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run)
        for c in tasks:
            writer.post(posted(c, Outcome(AttemptStatus.SUCCEEDED)))
        await writer.flushed()
        assert writer.pending == 0
        assert [answers[c.task.id] for c in tasks] == [State.COMPLETED] * 3
        # the first try carried all three; after the two refused tries the rest was written, in one call or,
        # when the retries' times fell apart under load, in several
        assert flaky.calls[0] == 3 and len(flaky.calls) >= 3 and flaky.away == 0, flaky.calls
        tg.cancel_scope.cancel()
    for c in tasks:
        assert (await store.get(c.task.id)).state is State.COMPLETED


async def test_a_store_away_longer_than_the_retries_reports_the_outcome_as_not_written(store: SqliteStore) -> None:
    flaky = Flaky(store)
    flaky.away = 10
    answers: dict[str, State | TidepoolError] = {}
    writer = OutcomeWriter(flaky, policy=lambda: POLICY,  # type: ignore[arg-type]
                           report=lambda p, a: answers.__setitem__(p.task.id, a), retry=Backoff(0.01, 0.01, tries=2))
    (task,) = await claimed(store, 1)
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run)
        writer.post(posted(task, Outcome(AttemptStatus.SUCCEEDED)))
        await writer.flushed()
        tg.cancel_scope.cancel()
    assert isinstance(answers[task.task.id], StoreUnavailable)
    assert len(flaky.calls) == 3, "the first try and one per retry delay"
    assert (await store.get(task.task.id)).state is State.LEASED, "its lease will expire: nothing was written"


async def test_a_report_that_fails_is_logged_and_the_others_are_still_written(store: SqliteStore) -> None:
    answers: dict[str, State | TidepoolError] = {}
    tasks = await claimed(store, 3)

    def report(p: Posted, answer: State | TidepoolError) -> None:
        if p.task.id == tasks[0].task.id:
            raise RuntimeError("a bug in a listener")
        answers[p.task.id] = answer

    writer = OutcomeWriter(store, policy=lambda: POLICY, report=report)
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run)
        for c in tasks:
            writer.post(posted(c, Outcome(AttemptStatus.SUCCEEDED)))
        await writer.flushed()
        late = (await claimed(store, 1))[0]  # the writer is still alive for what comes next
        writer.post(posted(late, Outcome(AttemptStatus.SUCCEEDED)))
        await writer.flushed()
        tg.cancel_scope.cancel()
    assert [answers[c.task.id] for c in tasks[1:]] == [State.COMPLETED] * 2
    assert answers[late.task.id] is State.COMPLETED


async def test_interruptions_a_shutdown_could_not_write_are_written_by_the_next_start(
        store: SqliteStore, tmp_path: Path) -> None:
    """The store is away through the shutdown: the writer still holds the interrupted outcome; kept in
    the state dir, the next start's recovery ends that attempt interrupted, not as a crash."""
    flaky = Flaky(store)
    flaky.away = 10**6
    # the store refuses at once, and the writer gives up after its retries (or is still trying)
    writer = OutcomeWriter(flaky, policy=lambda: POLICY, report=lambda p, a: None,  # type: ignore[arg-type]
                           retry=Backoff(0.01, 0.01, tries=1))
    given_up, still_tried = await claimed(store, 2)
    interrupted = Outcome(AttemptStatus.INTERRUPTED, TaskError("interrupted", "interrupted by shutdown"))
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run)
        writer.post(posted(given_up, interrupted))
        with anyio.move_on_after(0.3):
            await writer.flushed()
        flaky.calls.clear()
        writer.post(posted(still_tried, interrupted))
        while not flaky.calls:
            await anyio.sleep(0.001)
        tg.cancel_scope.cancel()
    assert {p.task.id for p in writer.unwritten()} == {given_up.task.id, still_tried.task.id}

    kept = UnwrittenInterruptions(tmp_path / "unwritten-interruptions.json")
    kept.keep(p.held.lease.attempt_id for p in writer.unwritten())
    again = UnwrittenInterruptions(tmp_path / "unwritten-interruptions.json")  # the next process
    ids = again.read()
    assert ids == {given_up.lease.attempt_id, still_tried.lease.attempt_id}
    expired = await store.expire_leases(now=time.time(), policy=POLICY, node_id=WORKER.node_id,
                                        keep_instance="the-next-process", interrupted=ids)
    again.forget()
    assert again.read() == frozenset(), "once written, forgotten"
    for c in (given_up, still_tried):
        t = await store.get(c.task.id)
        assert (t.state, t.attempt, t.interruptions, t.attempts[-1].status) == \
            (State.PENDING, 0, 1, AttemptStatus.INTERRUPTED)
    assert {e.state for e in expired} == {State.PENDING}
