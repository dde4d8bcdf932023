"""The bounds every store holds an attempt to, on each adapter: its run deadline (refused writes past it, the
reconciler ending it timed_out) and its result quota (refused batches past it, the attempt still ending)."""

from __future__ import annotations

import anyio
import pytest

from tidepool.errors import DeadlinePassed, LeaseLost, QuotaExceeded
from tidepool.model import AttemptStatus, Claimed, Phase, ResultBatch, State, sha256_of
from tidepool.store import PhaseNote, Store
from tidepool.store.port import ResultQuota

from .conftest import LEASE_S, POLICY, SUCCEEDED, T0
from .test_contract import changes_nothing, claim_one, leased, result

DEADLINE_S = 5.0 + 1.0 + LEASE_S  # a run timeout of 5 s, a stop phase of 1 s, one lease
QUOTA = ResultQuota(max_results=1000, max_bytes=2**20)


async def run_phase(store: Store, c: Claimed, *, now: float = T0, deadline_s: float | None = DEADLINE_S) -> None:
    notes = [PhaseNote(c.lease, Phase.INITIALIZE), PhaseNote(c.lease, Phase.RUN, deadline_s=deadline_s)]
    assert await store.set_phase(notes, now=now) == {}


async def renew_until(store: Store, c: Claimed, until: float) -> float:
    """Renew every 10 s (a third of the lease) while the store takes it; when it stopped taking it."""
    now = T0
    while now < until:
        now += 10.0
        lost = await store.renew([c.lease], now=now, lease_s=LEASE_S)
        if lost:
            assert isinstance(lost[c.lease.attempt_id], DeadlinePassed)
            return now
    return now


async def test_the_run_phase_fixes_the_attempts_deadline_and_a_later_note_never_moves_it(store: Store) -> None:
    c = await leased(store)
    await run_phase(store, c)
    later = PhaseNote(c.lease, Phase.RUN, {"fraction": 0.5, "message": "half"}, deadline_s=3600.0)
    assert await store.set_phase([later], now=T0 + 2) == {}
    (attempt,) = (await store.get(c.task.id)).attempts
    assert attempt.deadline_at == pytest.approx(T0 + DEADLINE_S)


async def test_renewals_stop_at_the_deadline_and_every_write_past_it_is_refused(store: Store) -> None:
    c = await leased(store)
    await run_phase(store, c)
    refused_at = await renew_until(store, c, T0 + 3600)
    assert T0 + DEADLINE_S < refused_at <= T0 + DEADLINE_S + 10.0  # the last renewal stopped short of it
    now = refused_at
    async with changes_nothing(store, c.task.id):
        with pytest.raises(DeadlinePassed):
            await store.record_result(c.lease, result("late"), now=now)
        assert isinstance((await store.set_phase([PhaseNote(c.lease, Phase.STOP)], now=now))[c.lease.attempt_id],
                          DeadlinePassed)
        with pytest.raises(DeadlinePassed):
            await store.finish(c.lease, SUCCEEDED, now=now, policy=POLICY)


async def test_the_reconciler_ends_an_attempt_past_its_deadline_timed_out(store: Store) -> None:
    c = await leased(store, max_attempts=3)
    await run_phase(store, c)
    refused_at = await renew_until(store, c, T0 + 3600)
    (expired,) = await store.expire_leases(now=refused_at, policy=POLICY)
    assert (expired.attempt_id, expired.state) == (c.lease.attempt_id, State.TIMED_OUT)
    task = await store.get(c.task.id)
    assert task.state is State.TIMED_OUT and task.error is not None and task.error.code == "timeout"
    assert task.attempts[0].status is AttemptStatus.TIMED_OUT
    assert c.lease.attempt_id in await store.renew([c.lease], now=refused_at + 1, lease_s=LEASE_S)  # void now


async def test_a_type_that_retries_timeouts_gets_another_attempt_after_its_deadline(store: Store) -> None:
    c = await leased(store, type="scan", max_attempts=3)
    await run_phase(store, c)
    refused_at = await renew_until(store, c, T0 + 3600)
    (expired,) = await store.expire_leases(now=refused_at, policy=POLICY, retry_on_timeout=frozenset({"scan"}))
    assert expired.state is State.RETRY_WAIT
    task = await store.get(c.task.id)
    assert task.attempts[0].status is AttemptStatus.TIMED_OUT and task.error is not None
    assert task.error.code == "timeout"


async def test_an_attempt_that_never_reports_its_run_phase_is_bounded_by_its_lease_alone(store: Store) -> None:
    c = await leased(store)
    assert await store.set_phase([PhaseNote(c.lease, Phase.PREPARE)], now=T0) == {}
    assert await renew_until(store, c, T0 + 600) >= T0 + 600  # renewed on and on, as before
    (attempt,) = (await store.get(c.task.id)).attempts
    assert attempt.deadline_at is None
    assert len(await store.expire_leases(now=T0 + 600 + LEASE_S + 1, policy=POLICY)) == 1
    assert (await store.get(c.task.id)).attempts[0].status is AttemptStatus.EXPIRED


async def test_a_lease_that_lapsed_before_its_deadline_expires_as_before(store: Store) -> None:
    c = await leased(store, max_attempts=1)
    await run_phase(store, c)  # the worker dies here: its lease lapses at T0 + LEASE_S, before the deadline
    with pytest.raises(LeaseLost) as lost:
        await store.record_result(c.lease, result("late"), now=T0 + LEASE_S + 1)
    assert not isinstance(lost.value, DeadlinePassed)
    await store.expire_leases(now=T0 + DEADLINE_S + 60, policy=POLICY)  # the reconciler comes late
    assert (await store.get(c.task.id)).attempts[0].status is AttemptStatus.EXPIRED


def big(n: int, size: int = 60_000) -> ResultBatch:
    payload = {"blob": f"{n:04d}" + "x" * (size - 4)}
    return ResultBatch("probe", n, f"k{n}", sha256_of(payload), False, payload)


async def test_results_past_the_byte_quota_are_refused_and_the_attempt_still_completes(store: Store) -> None:
    c = await leased(store)
    stored = 0
    for n in range(40):
        try:
            ack = await store.record_result(c.lease, big(n), now=T0, quota=QUOTA)
        except QuotaExceeded as exc:
            assert exc.code == "result_quota" and exc.http_status == 413
            continue
        assert ack.stored_now
        stored += 1
    assert stored == 17  # 17 batches of ~60 KB fit in 1 MiB, the 18th would not
    replay = await store.record_result(c.lease, big(3), now=T0, quota=QUOTA)  # sent again: no new batch
    assert not replay.stored_now
    assert await store.finish(c.lease, SUCCEEDED, now=T0 + 1, policy=POLICY) is State.COMPLETED
    task = await store.get(c.task.id)
    assert sorted(r.sequence for r in task.results) == list(range(17))


async def test_results_past_the_count_quota_change_nothing(store: Store) -> None:
    c = await leased(store)
    quota = ResultQuota(max_results=2, max_bytes=2**20)
    for key in ("a", "b"):
        await store.record_result(c.lease, result(key), now=T0, quota=quota)
    async with changes_nothing(store, c.task.id):
        with pytest.raises(QuotaExceeded):
            await store.record_result(c.lease, result("c"), now=T0, quota=quota)
    assert not (await store.record_result(c.lease, result("a"), now=T0, quota=quota)).stored_now
    assert await store.finish(c.lease, SUCCEEDED, now=T0 + 1, policy=POLICY) is State.COMPLETED


async def test_a_new_attempt_has_a_quota_of_its_own(store: Store) -> None:
    c = await leased(store, max_attempts=3)
    quota = ResultQuota(max_results=1, max_bytes=2**20)
    await store.record_result(c.lease, result("first"), now=T0, quota=quota)
    await store.expire_leases(now=T0 + LEASE_S + 1, policy=POLICY)
    await store.promote_due(now=T0 + 3600)
    again = await leased_again(store, c, now=T0 + 3600)
    assert (await store.record_result(again.lease, result("second"), now=T0 + 3600, quota=quota)).stored_now


async def leased_again(store: Store, c: Claimed, *, now: float) -> Claimed:
    again = await claim_one(store, now=now)
    assert again.task.id == c.task.id
    return again


async def test_concurrent_results_of_one_attempt_never_pass_its_quota_together(store: Store) -> None:
    c = await leased(store)
    quota = ResultQuota(max_results=5, max_bytes=2**20)
    stored: list[bool] = []

    async def write(n: int) -> None:
        try:
            ack = await store.record_result(c.lease, result(f"r{n}", {"n": n}), now=T0, quota=quota)
            stored.append(ack.stored_now)
        except QuotaExceeded:
            stored.append(False)

    async with anyio.create_task_group() as tg:
        for n in range(20):
            tg.start_soon(write, n)
    assert stored.count(True) == 5
    assert len((await store.get(c.task.id)).results) == 5
