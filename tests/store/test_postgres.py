"""PostgreSQL-only behaviour: several nodes on one schema, the schema's version, driver failures.

Runs against the real server (tests/conftest.py: failed, naming the address, when none is
reachable). Each test gets a schema of its own, dropped afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import anyio
import asyncpg
import pytest

from tidepool.errors import ConfigError, LeaseLost, SchemaMismatch, StoreUnavailable
from tidepool.model import AttemptStatus, Claimed, ClaimFilter, NewTask, Outcome, Phase, State, Worker
from tidepool.schedules import Schedule
from tidepool.store import Ended, Ending, PhaseNote, postgres
from tidepool.store.postgres import SCHEMA_VERSION, PostgresStore

from .conftest import ANY, LEASE_S, POLICY, SUCCEEDED, T0


@contextlib.asynccontextmanager
async def nodes(url: str, schema: str, n: int) -> AsyncIterator[list[PostgresStore]]:
    """n stores on one schema, as n daemons on n hosts would open it (all migrating at once)."""
    stores = [PostgresStore(url, schema=schema) for _ in range(n)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        yield stores
    finally:
        for s in stores:
            await s.close()


async def admin_fetch(url: str, sql: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


async def drain(store: PostgresStore, worker: Worker, where: ClaimFilter, limit: int) -> list[Claimed]:
    mine: list[Claimed] = []
    while got := await store.claim(worker, where, limit=limit, now=T0 + 1, lease_s=LEASE_S):
        mine.extend(got)
        await asyncio.sleep(0)
    return mine


async def test_two_nodes_claiming_at_once_never_claim_a_task_twice(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 2) as (a, b):
        added = await a.add_many([NewTask("noop", {"n": n}) for n in range(500)], now=T0)
        ids = [task_id for task_id, _ in added]
        # Filters that differ per claimer: claims of one node also race each other, ungrouped.
        claimers = [
            drain(store, Worker(f"node-{k}", f"{k}-1", f"w{i}"), ClaimFilter(types), 1 + i % 4)
            for k, store in enumerate((a, b))
            for i, types in enumerate((None, None, ("noop",), ("noop", "scan"), ("scan", "noop")))
        ]
        claimed = [c for mine in await asyncio.gather(*claimers) for c in mine]
        assert Counter(c.task.id for c in claimed) == Counter(ids)
        assert {c.task.node_id for c in claimed} == {"node-0", "node-1"}  # both nodes got work
        rows = await admin_fetch(url, f'SELECT task_id, count(*) FROM "{schema}".attempts GROUP BY task_id')
        assert len(rows) == 500 and {r[1] for r in rows} == {1}
        assert await a.renew([c.lease for c in claimed], now=T0 + 2, lease_s=LEASE_S) == {}


async def test_two_nodes_expiring_at_once_expire_each_lease_once(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 2) as (a, b):
        added = await a.add_many([NewTask("noop", max_attempts=3) for _ in range(600)], now=T0)
        ids = [task_id for task_id, _ in added]
        claimed = await drain(a, Worker("node-a", "a-1", "w1"), ANY, 64)
        assert len(claimed) == 600
        late = T0 + LEASE_S + 5
        passes = await asyncio.gather(*(s.expire_leases(now=late, policy=POLICY) for s in (a, b, a, b)))
        expired = Counter(e.task_id for p in passes for e in p)
        assert expired == Counter(ids)
        rows = await admin_fetch(
            url,
            f"SELECT task_id, count(*) FILTER (WHERE status = 'expired') FROM \"{schema}\".attempts GROUP BY task_id",
        )
        assert {r[1] for r in rows} == {1} and len(rows) == 600
        assert (await b.counts()) == {State.RETRY_WAIT: 600}


async def test_two_nodes_promote_and_cancel_each_task_once(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 2) as (a, b):
        await a.add_many([NewTask("noop") for _ in range(300)], now=T0)
        claimed = await drain(a, Worker("node-a", "a-1", "w1"), ANY, 50)
        failing = Outcome(AttemptStatus.FAILED)
        for c in claimed[:150]:
            assert await a.finish(c.lease, failing, now=T0 + 2, policy=POLICY) is State.RETRY_WAIT
        for c in claimed[150:]:
            assert (await b.request_cancel(c.task.id, now=T0 + 2)).state is State.CANCELLING
        promoted = await asyncio.gather(*(s.promote_due(now=T0 + 3600) for s in (a, b, a, b)))
        cancelled = await asyncio.gather(*(s.finish_cancels(now=T0 + 3600, deadline_s=60) for s in (a, b, a, b)))
        assert sum(promoted) == 150
        assert Counter(e.task_id for p in cancelled for e in p) == Counter(c.task.id for c in claimed[150:])
        assert (await a.counts()) == {State.PENDING: 150}


async def test_grouped_completions_answer_each_worker_alone(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 1) as (store,):
        await store.add_many([NewTask("noop") for _ in range(40)], now=T0)
        claimed = await drain(store, Worker("node-a", "a-1", "w1"), ANY, 40)
        await store.request_cancel(claimed[0].task.id, now=T0 + 1)
        leases = [c.lease for c in claimed]
        leases[1:3] = [dataclasses.replace(x, token="0" * 32) for x in leases[1:3]]  # stale tokens
        finishes = [store.finish(x, SUCCEEDED, now=T0 + 2, policy=POLICY) for x in leases]
        outcomes = await asyncio.gather(*finishes, return_exceptions=True)
        assert outcomes[0] is State.CANCELLED  # the cancel wins over the success, as the contract says
        assert all(isinstance(o, LeaseLost) for o in outcomes[1:3])
        assert outcomes[3:] == [State.COMPLETED] * 37
        assert (await store.counts()) == {State.LEASED: 2}
        rows = await admin_fetch(url, f"SELECT count(*) FROM \"{schema}\".attempts WHERE status = 'succeeded'")
        assert rows[0][0] == 37


async def test_caller_cancelled_mid_claim_does_not_fail_the_others(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 1) as (store,):
        await store.add_many([NewTask("noop") for _ in range(20)], now=T0)
        worker = Worker("node-a", "a-1", "w")
        calls = [asyncio.ensure_future(store.claim(worker, ANY, limit=1, now=T0, lease_s=LEASE_S)) for _ in range(10)]
        await asyncio.sleep(0)
        calls[0].cancel()
        calls[5].cancel()
        done = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(done[i], asyncio.CancelledError) for i in (0, 5))
        assert all(isinstance(d, list) and len(d) == 1 for i, d in enumerate(done) if i not in (0, 5))
        assert len(await drain(store, worker, ANY, 20)) >= 10  # what the cancelled callers took expires


async def test_multi_row_writes_over_the_same_leases_do_not_deadlock(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 2) as (a, b):
        await a.add_many([NewTask("noop") for _ in range(60)], now=T0)
        claimed = await drain(a, Worker("node-a", "a-1", "w1"), ANY, 60)
        leases = [c.lease for c in claimed]
        writes = []
        for k in range(6):  # the same rows, in opposite orders, from both nodes at once
            order = leases if k % 2 else leases[::-1]
            writes.append((a if k % 2 else b).renew(order, now=T0 + 2, lease_s=LEASE_S))
            writes.append((b if k % 2 else a).set_phase([PhaseNote(x, Phase.RUN) for x in order], now=T0 + 2))
        finished = leases[::7]
        writes.extend(a.finish(x, SUCCEEDED, now=T0 + 2, policy=POLICY) for x in finished)
        outcomes = await asyncio.gather(*writes, return_exceptions=True)
        # A deadlock would come back as an error; the only leases a renewal or a note may miss are the
        # ones finished meanwhile, and every finish lands.
        assert outcomes[12:] == [State.COMPLETED] * len(finished), outcomes[12:]
        gone = {x.attempt_id for x in finished}
        for missed in outcomes[:12]:
            assert isinstance(missed, dict), missed
            assert set(missed) <= gone and all(type(e) is LeaseLost for e in missed.values()), missed
        assert await a.counts() == {State.RUNNING: len(leases) - len(finished)}


TYPES = ["scan", "scan.deep", "Scan", "s", "a*b", "a-b", "a]b", "a[b", "x\\y", "ü", "üx", "a\nb", "[x]", "^$",
         "a.b", "axb", "(a)", "a%b", "a_b", "a?b", "a+b", "a{1}", "a|b", "!x", "—", "a b", "'", '"', "$1"]


@pytest.mark.parametrize("name", TYPES)
async def test_a_claim_takes_the_types_it_names_and_no_other(postgres_schema: tuple[str, str], name: str) -> None:
    """Type names are matched exactly, whatever they hold: none is read as a pattern."""
    url, schema = postgres_schema
    async with nodes(url, schema, 1) as (store,):
        await store.add_many([NewTask(t) for t in TYPES], now=T0)
        claimed = await drain(store, Worker("n", "i", "w"), ClaimFilter((name,)), 100)
        assert [c.task.type for c in claimed] == [name]


async def test_payloads_round_trip_exactly(postgres_schema: tuple[str, str]) -> None:
    payload = {"nul": "a\u0000b", "big": 2**70, "float": 0.1, "nested": {"z": 1, "a": [True, None]}}
    url, schema = postgres_schema
    async with nodes(url, schema, 1) as (store,):
        task, _ = await store.add(NewTask("noop", payload), now=T0)
        assert (await store.get(task.id)).payload == payload
        assert list((await store.get(task.id)).payload["nested"]) == ["z", "a"]  # key order kept


async def test_open_without_migrate_on_an_empty_schema_says_run_migrate(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    store = PostgresStore(url, schema=schema)
    with pytest.raises(SchemaMismatch, match="tidepool migrate"):
        await store.open(migrate=False)
    async with nodes(url, schema, 3):  # three nodes migrating at once: one creates, two find it done
        rows = await admin_fetch(url, f'SELECT version FROM "{schema}".schema_version')
        assert sorted(r[0] for r in rows) == list(range(1, SCHEMA_VERSION + 1))
    await store.open(migrate=False)
    await store.close()


async def test_an_older_schema_is_upgraded_in_place_by_migrate(
    postgres_schema: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, schema = postgres_schema
    monkeypatch.setattr(postgres, "SCHEMA_VERSION", 1)  # what the previous release created
    async with nodes(url, schema, 1):
        pass
    monkeypatch.undo()
    # a task as that release wrote it: the columns of version 1 only
    await admin_fetch(url, f'INSERT INTO "{schema}".tasks (id, type, payload, priority, state, max_attempts, '
                           "fingerprint, created_at, updated_at, available_at) "
                           """VALUES ('t-old', 'noop', '{"kept": true}', 0, 'pending', 3, '', $1, $1, $1)""", T0)
    with pytest.raises(SchemaMismatch, match=rf"version 1, needs {SCHEMA_VERSION}: run `tidepool migrate`"):
        await PostgresStore(url, schema=schema).open(migrate=False)
    async with nodes(url, schema, 2) as (a, _):
        task = await a.get("t-old")
        assert (task.payload, task.organization) == ({"kept": True}, "default")
        assert await a.list_schedules() == []
        assert [c.task.id for c in await a.claim(Worker("n", "i", "w"), ANY, limit=5, now=T0, lease_s=LEASE_S)] \
            == ["t-old"]


async def test_two_nodes_firing_schedules_at_once_fire_each_tick_once(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 2) as (a, b):
        for name in ("one", "two", "three"):
            await a.save_schedule(Schedule(name, "noop", every_s=1.0), now=0.5)
        for second in range(1, 6):
            passes = [s.fire_schedules(now=second + 0.1) for s in (a, b, a, b)]
            fired = [f for p in await asyncio.gather(*passes) for f in p]
            assert sorted(f.schedule for f in fired) == ["one", "three", "two"]
        keys = [t.idempotency_key for t in (await a.list_tasks(limit=100)).tasks]
        assert len(keys) == 15 and len(set(keys)) == 15


async def test_schema_newer_than_this_tidepool_is_refused(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 1):
        await admin_fetch(url, f'INSERT INTO "{schema}".schema_version VALUES ($1, 0)', SCHEMA_VERSION + 1)
    with pytest.raises(SchemaMismatch, match="upgrade tidepool"):
        await PostgresStore(url, schema=schema).open()


async def test_unreachable_server_raises_store_unavailable() -> None:
    store = PostgresStore("postgresql://postgres@127.0.0.1:1/test", schema="t_unreachable")
    with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1:1") as caught:
        await store.open()
    assert isinstance(caught.value.__cause__, OSError)
    with pytest.raises(StoreUnavailable, match="not open"):
        await store.counts()


async def test_a_server_that_accepts_and_never_answers_is_said_in_words_within_the_connect_timeout() -> None:
    """A blackholed database: the message was "TimeoutError: " and an API call waited a minute."""
    held: list[asyncio.StreamWriter] = []

    async def accept_and_say_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        store = PostgresStore(f"postgresql://postgres@127.0.0.1:{port}/test", schema="t_blackhole",
                              connect_timeout_s=0.5)
        with anyio.fail_after(5):
            with pytest.raises(StoreUnavailable, match=r"no answer in time.*stuck"):
                await store.open()
    finally:
        for writer in held:
            writer.close()
        server.close()


class Link:
    """A TCP relay to the real server that can be blackholed: it keeps every connection and drops the bytes."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.blackholed = False
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self.upstream)
        self.writers += [client_w, server_w]

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await r.read(65536):
                    if not self.blackholed:
                        w.write(data)

        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))

    def close(self) -> None:
        for w in self.writers:
            w.close()
        if self.server is not None:
            self.server.close()


async def test_every_call_on_a_server_that_stops_answering_is_store_unavailable_within_its_deadline(
        postgres_schema: tuple[str, str]) -> None:
    """A blackholed database (packets dropped: a firewall, a dead switch) answers nothing and fails nothing.
    With the store's own timeouts, every kind of call must still end as StoreUnavailable naming the store,
    within its deadline and not a statement timeout or two later: an API call waited 40 s once. Giving a
    connection back resets it, a round trip that times out too: that TimeoutError once escaped raw and ended
    the daemon."""
    url, schema = postgres_schema
    server = urlsplit(url)
    link = Link(server.hostname or "127.0.0.1", server.port or 5432)
    port = await link.start()
    store = PostgresStore(urlunsplit(server._replace(netloc=f"{server.username}@127.0.0.1:{port}")), schema=schema)
    worker = Worker("node-a", "a-1", "w1")
    try:
        await store.open()
        await store.add_many([NewTask("noop") for _ in range(3)], now=T0)
        claimed = await drain(store, worker, ANY, 2)
        link.blackholed = True
        for _ in range(2):  # the connections of before, then new ones (their handshakes go unanswered too)
            calls = [store.counts(), store.add(NewTask("noop"), now=T0, max_queued=100), store.write_failure(),
                     store.claim(worker, ANY, limit=1, now=T0 + 1, lease_s=LEASE_S),
                     store.renew([claimed[0].lease], now=T0 + 1, lease_s=LEASE_S),
                     store.finish(claimed[1].lease, SUCCEEDED, now=T0 + 1, policy=POLICY)]
            started = time.monotonic()
            with anyio.fail_after(postgres.CALL_TIMEOUT_S + 3):
                outcomes = await asyncio.gather(*calls, return_exceptions=True)
            assert [type(o) for o in outcomes] == [StoreUnavailable] * len(calls), outcomes
            assert all(f"store 127.0.0.1:{port}/test schema {schema}" in str(o) for o in outcomes), outcomes
            assert time.monotonic() - started < postgres.CALL_TIMEOUT_S + 1.5
        link.blackholed = False  # the connections cut off mid-statement were closed: new ones serve at once
        assert await store.counts() == {State.LEASED: 3}  # the drain took all three; nothing blackholed landed
    finally:
        link.close()
        with anyio.move_on_after(5):
            await store.close()


async def test_a_big_batch_gets_time_by_its_rows_beyond_the_deadline_of_one_call(
        postgres_schema: tuple[str, str]) -> None:
    """Ten thousand tasks take a second or more to write: the deadline that makes a stuck server answer 503
    in seconds must not refuse them."""
    url, schema = postgres_schema
    store = PostgresStore(url, schema=schema, call_timeout_s=0.1)
    await store.open()
    try:
        added = await store.add_many([NewTask("noop", {"n": n}, idempotency_key=f"k{n}") for n in range(10_000)],
                                     now=T0, max_queued=100_000)
        assert len(added) == 10_000 and all(created for _, created in added)
    finally:
        await store.close()


async def test_store_serves_again_after_the_server_drops_its_connections(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 1) as (store,):
        task, _ = await store.add(NewTask("noop"), now=T0)
        killed = await admin_fetch(
            url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            f"tidepool {schema}",
        )
        assert killed
        outcomes: list[object] = []
        for _ in range(12):  # each pooled connection the server dropped may fail one call, then is replaced
            try:
                outcomes.append((await store.get(task.id)).id)
            except StoreUnavailable as exc:
                assert isinstance(exc.__cause__, postgres.DRIVER_ERRORS)
                outcomes.append(exc)
        assert outcomes[-5:] == [task.id] * 5


def test_schema_must_be_a_plain_name() -> None:
    with pytest.raises(ConfigError, match="schema"):
        PostgresStore("postgresql://localhost/db", schema='x"; DROP TABLE y; --')


async def test_list_and_get_show_attempts_and_results(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 1) as (store,):
        await store.add(NewTask("noop", {"x": 1}), now=T0)
        (c,) = await store.claim(Worker("n", "i", "w"), ANY, limit=1, now=T0, lease_s=LEASE_S)
        rows = await admin_fetch(url, f'SELECT payload FROM "{schema}".tasks')
        assert json.loads(rows[0][0]) == {"x": 1}
        page = await store.list_tasks()
        assert [a.id for a in page.tasks[0].attempts] == [c.lease.attempt_id]


async def test_a_resent_ending_that_was_written_unanswered_gets_its_state_not_lease_lost(
        postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 1) as (store,):
        await store.add_many([NewTask("noop") for _ in range(3)], now=T0)
        claimed = await drain(store, Worker("node-a", "a-1", "w1"), ANY, 3)
        endings = [Ending(c.lease, SUCCEEDED, T0 + 1) for c in claimed]
        assert await store.finish_many(endings, policy=POLICY) == [State.COMPLETED] * 3  # "the answer got lost"
        again = await store.finish_many([dataclasses.replace(e, resent=True) for e in endings], policy=POLICY)
        assert again == [State.COMPLETED] * 3
        fresh = await store.finish_many(endings[:1], policy=POLICY)  # not marked resent: a second ending is refused
        assert isinstance(fresh[0], LeaseLost)


async def test_a_resent_ending_is_not_credited_with_an_end_someone_else_wrote(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with nodes(url, schema, 1) as (store,):
        await store.add_many([NewTask("noop")], now=T0)
        (c,) = await drain(store, Worker("node-a", "a-1", "w1"), ANY, 1)
        await store.request_cancel(c.task.id, now=T0 + 1)
        assert await store.finish_cancels(now=T0 + 100, deadline_s=10) == [Ended(c.task.id, "noop")]  # the reconciler
        (answer,) = await store.finish_many([Ending(c.lease, SUCCEEDED, T0 + 2, resent=True)], policy=POLICY)
        assert isinstance(answer, LeaseLost), "the worker's own end was never written: it must not report one"


async def test_a_server_that_takes_no_writes_is_said_by_write_failure(postgres_schema: tuple[str, str]) -> None:
    """A failover can leave a node's URL on a standby: every read answers, every write is refused. The
    readiness probe asks write_failure(), which must tell; a write says why. (A role whose transactions
    are read-only stands in for the standby: the server answers the same way to both.)"""
    url, schema = postgres_schema
    role = "ro_" + schema
    async with nodes(url, schema, 1) as (primary,):
        assert await primary.write_failure() is None
        await admin_fetch(url, f'CREATE ROLE "{role}" LOGIN')
        try:
            for grant in (f'ALTER ROLE "{role}" SET default_transaction_read_only = on',
                          f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"',
                          f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"'):
                await admin_fetch(url, grant)
            parts = urlsplit(url)
            as_role = urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port or 5432}"))
            standby = PostgresStore(as_role, schema=schema)
            await standby.open(migrate=False)
            try:
                failure = await standby.write_failure()
                assert failure is not None and "read-only" in failure and "refused" in failure
                assert await standby.counts() == {}, "reads still answer"
                with pytest.raises(StoreUnavailable, match="read-only"):
                    await standby.add(NewTask("noop"), now=T0)
            finally:
                await standby.close()
            assert await primary.write_failure() is None
        finally:
            await admin_fetch(url, f'DROP OWNED BY "{role}"')
            await admin_fetch(url, f'DROP ROLE "{role}"')
