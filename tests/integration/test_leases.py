"""The lease keeper against a store that goes away: its writes are retried, and the outage is said once."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import anyio
import pytest

from tidepool.errors import LeaseLost, StoreUnavailable
from tidepool.execution.leases import LeaseKeeper
from tidepool.lifecycle import RetryPolicy
from tidepool.model import ClaimFilter, NewTask, Phase, Worker
from tidepool.store import PhaseNote
from tidepool.store.sqlite import SqliteStore

WORKER = Worker("test-node", "i1", "test-node/w1")


class Away:
    """The real store; while `away`, its phase notes fail as a refused connection would."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self.away = True

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        if self.away:
            raise StoreUnavailable("connection refused")
        return await self.store.set_phase(notes, now=now)


async def test_notes_that_cannot_be_written_are_kept_and_the_outage_is_logged_once(
        store: SqliteStore, caplog: pytest.LogCaptureFixture) -> None:
    await store.add(NewTask("noop"), now=time.time())
    (claimed,) = await store.claim(WORKER, ClaimFilter(), limit=1, now=time.time(), lease_s=30.0)
    flaky = Away(store)
    keeper = LeaseKeeper(flaky, lease_s=30.0, renew_every_s=10.0)  # type: ignore[arg-type]
    held = keeper.hold(claimed.lease)
    caplog.set_level(logging.INFO, logger="tidepool.leases")
    keeper.note(held, Phase.RUN, {"fraction": 0.5})
    for _ in range(10):  # a second of flushes while the store is away
        await keeper.flush()
    assert (await store.get(claimed.task.id)).progress is None
    flaky.away = False
    await keeper.flush()
    assert (await store.get(claimed.task.id)).progress == {"fraction": 0.5}, "kept, and written once it could be"
    said = [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records]
    assert said == [("WARNING", "lease phase writes fail, retrying until the store answers"),
                    ("INFO", "lease phase writes go through again")]


async def test_a_lease_found_lost_is_said_once_and_not_renewed_again(
        store: SqliteStore, caplog: pytest.LogCaptureFixture) -> None:
    """A plugin that does not stop at once (a blocking call, a swallowed cancel) keeps its Held a while:
    each renewal sent it again, and each refusal logged the loss again."""
    now = time.time()
    await store.add(NewTask("noop"), now=now)
    (claimed,) = await store.claim(WORKER, ClaimFilter(), limit=1, now=now, lease_s=1.0)
    keeper = LeaseKeeper(store, lease_s=30.0, renew_every_s=10.0)
    held = keeper.hold(claimed.lease)
    await store.expire_leases(now=now + 2, policy=RetryPolicy())  # another node may now take the task
    caplog.set_level(logging.INFO, logger="tidepool.leases")
    for _ in range(3):
        await keeper.renew()
    assert held.why == "lost" and held.scope.cancel_called
    lost = [r for r in caplog.records if "lease lost" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelname == "WARNING", [r.getMessage() for r in caplog.records]


class Blackhole:
    """The real store, but a renewal never answers: a database behind a link that accepts and drops."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        return await self.store.set_phase(notes, now=now)

    async def renew(self, leases: Sequence[object], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def test_a_renewal_that_never_answers_still_stops_the_attempt_before_the_store_expires_its_lease(
        store: SqliteStore) -> None:
    """Another node may take the task once the store's lease runs out: by then this node's plugin must
    have been told to stop, with a quarter of the lease to do it in, whatever the stuck write does."""
    await store.add(NewTask("noop"), now=time.time())
    (claimed,) = await store.claim(WORKER, ClaimFilter(), limit=1, now=time.time(), lease_s=2.0)
    keeper = LeaseKeeper(Blackhole(store), lease_s=2.0, renew_every_s=0.5, flush_every_s=0.05)  # type: ignore[arg-type]
    held = keeper.hold(claimed.lease)
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        with anyio.fail_after(10):
            while not held.scope.cancel_called:
                await anyio.sleep(0.02)
        stopped_at = time.time()
        tg.cancel_scope.cancel()
    assert held.why == "lost"
    assert stopped_at <= claimed.lease.expires_at - 0.25, "stopped with time to spare before others may take it"


async def test_a_reload_that_lengthens_the_lease_leaves_the_leases_granted_before_it_alone(
        store: SqliteStore) -> None:
    """The give-up margin belongs to the lease as granted: judged with the new, longer lease's margin, a
    lease renewed a moment ago looked overdue and its attempt was stopped."""
    await store.add(NewTask("noop"), now=time.time())
    (claimed,) = await store.claim(WORKER, ClaimFilter(), limit=1, now=time.time(), lease_s=30.0)
    keeper = LeaseKeeper(store, lease_s=30.0, renew_every_s=10.0)
    held = keeper.hold(claimed.lease)
    keeper.configure(lease_s=120.0, renew_every_s=40.0)  # SIGHUP
    keeper._give_up_overdue()
    assert held.why is None and not held.scope.cancel_called
    assert 29.0 - 30.0 * 0.25 < keeper.time_left(held) <= 30.0 - 30.0 * 0.25


def test_the_margin_never_takes_the_slack_renewals_need() -> None:
    """At renew_every_s = half the lease two renewals just fit: no margin is left, as before it existed."""
    assert LeaseKeeper(None, lease_s=30.0, renew_every_s=10.0)._margin_s() == 7.5  # type: ignore[arg-type]
    assert LeaseKeeper(None, lease_s=30.0, renew_every_s=13.0)._margin_s() == 4.0  # type: ignore[arg-type]
    assert LeaseKeeper(None, lease_s=30.0, renew_every_s=15.0)._margin_s() == 0.0  # type: ignore[arg-type]
