"""The fleet verbs of the store: the node registry on every adapter; on PostgreSQL also the node lock and
the wake-ups (NOTIFY on every write that makes tasks claimable, heard by watch() on other stores)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import asyncpg
import pytest
from anyio.abc import TaskStatus

from tidepool.api.node import NodeOut
from tidepool.errors import ConfigError
from tidepool.lifecycle import RetryPolicy
from tidepool.model import AttemptStatus, NewTask, Outcome, State, TaskError, Worker
from tidepool.schedules import Schedule
from tidepool.store import Node, Store
from tidepool.store.postgres import PostgresStore, channel_for

from .conftest import ANY, T0

POLICY = RetryPolicy(base_s=0.0, max_s=0.0, jitter=0.0, max_interruptions=10)


def node(node_id: str = "host-a", **changes: object) -> Node:
    base = Node(node_id, "inst-1", "host-a.example", 4242, "0.1.0", T0, T0 + 5, 2.0, ("scan", "noop*"),
                (("win10",), ("linux", "nic")), 16)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


# the registry: every adapter


async def test_a_saved_node_lists_with_every_field(store: Store) -> None:
    await store.save_node(node("host-b"))
    await store.save_node(node("host-a"))
    assert await store.list_nodes() == [node("host-a"), node("host-b")]


async def test_saving_again_replaces_the_row_of_that_node_id(store: Store) -> None:
    await store.save_node(node())
    restarted = node(instance_id="inst-2", pid=99, started_at=T0 + 60, heartbeat_at=T0 + 61, max_workers=4,
                     task_types=("*",), tags=())
    await store.save_node(restarted)
    assert await store.list_nodes() == [restarted]
    stopped = dataclasses.replace(restarted, stopped_at=T0 + 70)
    await store.save_node(stopped)
    assert await store.list_nodes() == [stopped]


async def test_alive_means_heard_from_within_three_heartbeats_and_not_stopped(store: Store) -> None:
    await store.save_node(node(heartbeat_at=T0, heartbeat_s=2.0))
    (n,) = await store.list_nodes()
    assert n.alive(T0 + 5.9) and not n.alive(T0 + 6.1)
    assert not dataclasses.replace(n, stopped_at=T0).alive(T0 + 1)
    shown = NodeOut.of(n, now=T0 + 1).to_json()
    assert shown["alive"] is True and shown["tags"] == [["win10"], ["linux", "nic"]]
    assert shown["heartbeat_at"].endswith("Z") and shown["stopped_at"] is None


async def test_prune_forgets_nodes_not_heard_from_since_before(store: Store) -> None:
    await store.save_node(node("old", heartbeat_at=T0))
    await store.save_node(node("new", heartbeat_at=T0 + 100))
    await store.prune(before=T0 + 50)
    assert [n.node_id for n in await store.list_nodes()] == ["new"]


async def test_watch_reports_started_and_stops_when_cancelled(store: Store) -> None:
    returned: list[bool] = []

    async def watching(*, task_status: TaskStatus[None]) -> None:
        await store.watch(lambda n: None, task_status=task_status)
        returned.append(True)  # only a watch that ends by itself gets here

    with anyio.fail_after(5):  # a watch that never reports started, or outlives its cancel, fails here
        async with anyio.create_task_group() as tg:
            await tg.start(watching)
            await anyio.sleep(0.1)
            assert returned == [], "watch returned by itself: it watches until cancelled"
            tg.cancel_scope.cancel()
    assert returned == [] and tg.cancel_scope.cancel_called


# PostgreSQL: the node lock and the wake-ups between nodes


@asynccontextmanager
async def opened(url: str, schema: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore(url, schema=schema)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


class Wakes:
    """What watch() reported, with a way to wait for the next one."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self._event = asyncio.Event()

    def __call__(self, n: int) -> None:
        self.seen.append(n)
        self._event.set()

    async def next(self, timeout_s: float = 5.0) -> int:
        await asyncio.wait_for(self._event.wait(), timeout_s)
        self._event.clear()
        n = self.seen[-1]
        self.seen.clear()
        return n

    async def none(self, wait_s: float = 0.3) -> None:
        await asyncio.sleep(wait_s)
        assert self.seen == []


@asynccontextmanager
async def listening(store: PostgresStore) -> AsyncIterator[Wakes]:
    wakes = Wakes()
    async with anyio.create_task_group() as tg:
        await tg.start(store.watch, wakes)
        await asyncio.sleep(0.2)  # LISTEN has been sent once the connection answered a statement
        yield wakes
        tg.cancel_scope.cancel()


async def test_a_second_process_cannot_take_a_held_node_id_and_is_told_who_holds_it(
        postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with opened(url, schema) as first, opened(url, schema) as second:
        await first.lock_node("host-a", "inst-1")
        await first.save_node(node("host-a", pid=os.getpid()))
        with pytest.raises(ConfigError, match=rf"node host-a already runs .* pid {os.getpid()} on host-a.example"):
            await second.lock_node("host-a", "inst-2")
        await second.lock_node("host-b", "inst-3")  # another node id is free
    async with opened(url, schema) as third:  # the holder closed: its lock went with its session
        await third.lock_node("host-a", "inst-4")


async def test_the_node_lock_belongs_to_the_schema(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with opened(url, schema) as a, opened(url, schema) as same_fleet, \
            opened(url, schema + "_other") as b, opened(url, schema + "_other") as b_fleet:
        try:
            await a.lock_node("host-a", "inst-1")
            with pytest.raises(ConfigError, match="host-a already runs"):
                await same_fleet.lock_node("host-a", "inst-2")  # held in this schema
            await b.lock_node("host-a", "inst-3")  # another fleet in the same database: free there
            with pytest.raises(ConfigError, match="host-a already runs"):
                await b_fleet.lock_node("host-a", "inst-4")  # and now held there too
        finally:
            conn = await asyncpg.connect(url)
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}_other" CASCADE')
            await conn.close()


async def test_submits_on_one_node_wake_the_others(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with opened(url, schema) as a, opened(url, schema) as b, listening(b) as wakes:
        await a.add(NewTask("noop"), now=T0)
        assert await wakes.next() == 1
        await a.add_many([NewTask("noop") for _ in range(7)], now=T0)
        assert await wakes.next() == 7
        await a.add(NewTask("noop", idempotency_key="k"), now=T0)
        assert await wakes.next() == 1
        await a.add(NewTask("noop", idempotency_key="k"), now=T0)  # the existing task: nothing new to claim
        await wakes.none()


async def test_promotions_interruptions_retries_and_schedule_fires_wake_the_others(
        postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with opened(url, schema) as a, opened(url, schema) as b, listening(b) as wakes:
        await a.add_many([NewTask("noop", max_attempts=1) for _ in range(3)], now=T0)
        await wakes.next()
        c1, c2, c3 = await a.claim(Worker("host-a", "i", "w"), ANY, limit=3, now=T0, lease_s=30)
        await a.finish(c1.lease, Outcome(AttemptStatus.INTERRUPTED), now=T0 + 1, policy=POLICY)
        assert await wakes.next() == 1  # interrupted: pending again at once
        await a.finish(c2.lease, Outcome(AttemptStatus.FAILED, TaskError("x", "y")), now=T0 + 1, policy=POLICY)
        await wakes.none()  # failed for good: nothing to claim
        await a.retry(c2.task.id, now=T0 + 2)
        assert await wakes.next() == 1
        await a.finish(c3.lease, Outcome(AttemptStatus.SUCCEEDED), now=T0 + 1, policy=POLICY)
        await wakes.none()
        await a.save_schedule(Schedule("tick", "noop", every_s=10.0), now=T0)
        await wakes.none()
        fired = await a.fire_schedules(now=T0 + 10.5)
        assert [f.task_id is not None for f in fired] == [True]
        assert await wakes.next() >= 1


async def test_a_retry_promotion_wakes_the_others_with_how_many(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    policy = RetryPolicy(base_s=10.0, max_s=10.0, jitter=0.0, max_interruptions=10)
    async with opened(url, schema) as a, opened(url, schema) as b, listening(b) as wakes:
        await a.add_many([NewTask("noop") for _ in range(4)], now=T0)
        await wakes.next()
        for c in await a.claim(Worker("host-a", "i", "w"), ANY, limit=4, now=T0, lease_s=30):
            assert await a.finish(c.lease, Outcome(AttemptStatus.FAILED), now=T0 + 1, policy=policy) \
                is State.RETRY_WAIT
        await wakes.none()  # backoff: not claimable yet
        assert await a.promote_due(now=T0 + 5) == 0
        await wakes.none()
        assert await a.promote_due(now=T0 + 20) == 4
        assert await wakes.next() == 4


async def test_watch_comes_back_after_its_connection_is_dropped_and_keeps_the_node_lock(
        postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    async with opened(url, schema) as a, opened(url, schema) as b, opened(url, schema) as c:
        await b.lock_node("host-b", "inst-b")
        async with listening(b) as wakes:
            admin = await asyncpg.connect(url)
            try:
                killed = await admin.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
                    f"tidepool {schema} session")
            finally:
                await admin.close()
            assert killed == 1
            assert await wakes.next() >= 100  # reconnected: every sleeping worker is woken for what it missed
            await a.add(NewTask("noop"), now=T0)
            assert await wakes.next() == 1
            with pytest.raises(ConfigError, match="host-b already runs"):
                await c.lock_node("host-b", "inst-c")


async def test_the_schema_can_come_from_the_url(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    store = PostgresStore(f"{url}?schema={schema}")
    assert store.schema == schema and "schema=" not in store.url
    assert PostgresStore(f"{url}?sslmode=disable&schema={schema}").url == f"{url}?sslmode=disable"
    await store.open()
    try:
        task, _ = await store.add(NewTask("noop"), now=T0)
    finally:
        await store.close()
    async with opened(url, schema) as same:
        assert (await same.get(task.id)).id == task.id
    assert PostgresStore(url).schema == "tidepool"


def test_channel_names_fit_postgres_limit() -> None:
    assert channel_for("t_abc") == "tidepool.t_abc"
    long = "s" * 63
    assert len(channel_for(long)) <= 63 and channel_for(long) != channel_for("s" * 62 + "t")
