"""The notices of a PostgreSQL store several gateways share: a cancel of a remote attempt and a change of a
worker's record reach the other processes' listeners, in the order the change made them, and not the process
that sent them; wake-ups stay wake-ups."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio

from tidepool.model import ClaimFilter, NewTask, Worker, WorkerChange, WorkerState
from tidepool.store.notices import Notice, NoticeKind, NoticeSource
from tidepool.store.postgres import PostgresStore

from .conftest import CERT_1, LEASE_S, SCANNER, T0


class Heard:
    def __init__(self) -> None:
        self.notices: list[Notice] = []
        self.wakes = 0

    def wake(self, n: int) -> None:
        self.wakes += n

    async def notices_at_least(self, n: int) -> list[Notice]:
        with anyio.fail_after(5):
            while len(self.notices) < n:
                await anyio.sleep(0.01)
        return self.notices


@contextlib.asynccontextmanager
async def two_processes(postgres_schema: tuple[str, str]) -> AsyncIterator[tuple[PostgresStore, Heard, Heard]]:
    """Two stores on one schema, each listening: (the one that acts, what it heard, what the other heard)."""
    url, schema = postgres_schema
    acting, other = PostgresStore(url, schema=schema), PostgresStore(url, schema=schema)
    await acting.open()
    await other.open()
    heard_here, heard_there = Heard(), Heard()
    acting.hear_notices(heard_here.notices.append)
    other.hear_notices(heard_there.notices.append)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(acting.watch, heard_here.wake)
            await tg.start(other.watch, heard_there.wake)
            with anyio.fail_after(5):  # both LISTEN: a submit's wake-up reaches each
                while not (heard_here.wakes and heard_there.wakes):
                    await acting.add(NewTask("probe"), now=T0)
                    await anyio.sleep(0.05)
            yield acting, heard_here, heard_there
            tg.cancel_scope.cancel()
    finally:
        await acting.close()
        await other.close()


async def test_a_revoke_tells_the_other_process_each_cancel_then_the_state(
        postgres_schema: tuple[str, str]) -> None:
    async with two_processes(postgres_schema) as (store, here, there):
        assert isinstance(store, NoticeSource)
        await store.meet_worker(SCANNER, cert=CERT_1, address=None, now=T0, enroll="auto", max_concurrent_tasks=4)
        for _ in range(2):
            await store.add(NewTask("scan"), now=T0)
        acquired = await store.acquire(SCANNER, ClaimFilter(("scan",)), limit=2, now=T0 + 1, lease_s=LEASE_S,
                                       worker_id=SCANNER, slots=(), version=None)
        await store.revoke_worker(SCANNER, now=T0 + 2)
        attempts = sorted(c.lease.attempt_id for c in acquired.claimed)
        *cancels, state = await there.notices_at_least(3)
        assert sorted((n.kind, n.worker_id, n.attempt_id) for n in cancels) == [
            (NoticeKind.CANCEL, SCANNER, a) for a in attempts]
        assert state == Notice(NoticeKind.WORKER, SCANNER, state="revoked")
        assert here.notices == []  # its own changes it acts on in memory


async def test_a_change_and_a_cancel_of_a_remote_attempt_are_told_a_local_ones_cancel_is_not(
        postgres_schema: tuple[str, str]) -> None:
    async with two_processes(postgres_schema) as (store, _here, there):
        await store.meet_worker(SCANNER, cert=CERT_1, address=None, now=T0, enroll="auto", max_concurrent_tasks=4)
        local, _ = await store.add(NewTask("local"), now=T0)
        await store.claim(Worker("node-a", "a-1", "w-1"), ClaimFilter(("local",)), limit=1, now=T0 + 1,
                          lease_s=LEASE_S)
        await store.request_cancel(local.id, now=T0 + 2)
        await store.change_worker(SCANNER, WorkerChange(state=WorkerState.DISABLED), now=T0 + 3)
        remote, _ = await store.add(NewTask("scan"), now=T0)
        await store.change_worker(SCANNER, WorkerChange(state=WorkerState.ENABLED), now=T0 + 4)
        (claimed,) = (await store.acquire(SCANNER, ClaimFilter(("scan",)), limit=1, now=T0 + 5, lease_s=LEASE_S,
                                          worker_id=SCANNER, slots=(), version=None)).claimed
        await store.request_cancel(remote.id, now=T0 + 6)
        assert await there.notices_at_least(3) == [
            Notice(NoticeKind.WORKER, SCANNER, state="disabled"), Notice(NoticeKind.WORKER, SCANNER, state="enabled"),
            Notice(NoticeKind.CANCEL, SCANNER, attempt_id=claimed.lease.attempt_id)]
