"""A local attempt's bounds as the engine meets them on a real SQLite store: the run deadline its run phase
starts, and the result quota of [execution] (a plugin's emit past it raises QuotaExceeded, said once)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import anyio
import pytest

from tidepool.errors import QuotaExceeded
from tidepool.events import Event, EventBus
from tidepool.execution.context import TaskContext
from tidepool.execution.engine import EngineConfig
from tidepool.lifecycle import RetryPolicy
from tidepool.model import ClaimFilter, NewTask, Phase, State, Worker
from tidepool.settings import TypeSettings, parse
from tidepool.store import PhaseNote
from tidepool.store.port import ResultQuota
from tidepool.store.sqlite import SqliteStore
from tidepool.upkeep.reconciler import Reconciler, ReconcilerConfig

from .conftest import running_node

QUOTA = EngineConfig(stop_timeout_s=2.0, result_quota=ResultQuota(max_results=3, max_bytes=2**20))


async def test_the_run_phase_gives_a_local_attempt_its_deadline(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    async def short(ctx: TaskContext) -> None:
        await anyio.sleep(0.2)  # long enough for a phase note to be flushed

    types = {"short": TypeSettings(plugins=("short",), timeout_s=7.0)}
    before = time.time()
    async with running_node(sqlite_store, {"short": short}, types=types, lease_s=30.0,
                            work_root=tmp_path) as node:
        task = await node.finished(await node.submit("short"))
    assert task.state is State.COMPLETED
    deadline_at = task.attempts[0].deadline_at
    assert deadline_at is not None
    assert before + 7.0 + 2.0 + 30.0 <= deadline_at <= time.time() + 7.0 + 2.0 + 30.0


async def test_a_plugin_past_its_result_quota_is_refused_and_may_go_on(sqlite_store: SqliteStore, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    refused = []

    async def chatty(ctx: TaskContext) -> None:
        for n in range(6):
            try:
                await ctx.emit({"n": n})
            except QuotaExceeded as exc:
                refused.append(exc.code)

    caplog.set_level(logging.WARNING, "tidepool.engine")
    async with running_node(sqlite_store, {"chatty": chatty}, engine_config=QUOTA, work_root=tmp_path) as node:
        task = await node.finished(await node.submit("chatty"))
    assert task.state is State.COMPLETED
    assert [r.payload for r in task.results] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert refused == ["result_quota"] * 3
    said = [r.getMessage() for r in caplog.records if "over its quota" in r.getMessage()]
    assert len(said) == 1 and task.id in said[0]


async def test_a_plugin_that_lets_the_refusal_through_fails_its_attempt_for_good(sqlite_store: SqliteStore,
                                                                                 tmp_path: Path) -> None:
    async def flood(ctx: TaskContext) -> None:
        for n in range(10):
            await ctx.emit({"n": n})

    async with running_node(sqlite_store, {"flood": flood}, engine_config=QUOTA, work_root=tmp_path) as node:
        task = await node.finished(await node.submit("flood", max_attempts=3))
    assert task.state is State.FAILED
    assert task.error is not None and task.error.code == "result_quota"
    assert len(task.attempts) == 1  # it would meet its quota again: not retried


async def test_the_reconciler_ends_an_attempt_past_its_deadline_as_its_type_says(sqlite_store: SqliteStore) -> None:
    t0 = 1_700_000_000.0
    seen: list[Event] = []
    events = EventBus()
    events.listen(seen.append)
    settings = parse({"types": {"scan": {"plugins": ["noop"], "retry_on_timeout": True},
                                "once": {"plugins": ["noop"]}}})
    config = ReconcilerConfig.of(settings.reconciler, settings.execution, settings.all_types)
    reconciler = Reconciler(sqlite_store, events, config=config, policy=lambda: RetryPolicy(base_s=900.0, jitter=0.0),
                            wake=lambda n: None, clock=lambda: t0 + 100)
    await sqlite_store.open()
    try:
        for type in ("scan", "once"):
            await sqlite_store.add(NewTask(type, max_attempts=2), now=t0)
            (claimed,) = await sqlite_store.claim(Worker("n", "i", "w"), ClaimFilter((type,)), limit=1, now=t0,
                                                  lease_s=30.0)
            await sqlite_store.set_phase([PhaseNote(claimed.lease, Phase.RUN, deadline_s=10.0)], now=t0)
            await sqlite_store.renew([claimed.lease], now=t0 + 5, lease_s=30.0)  # up to the deadline, no further
        report = await reconciler.pass_once()
        states = {t.type: t.state for t in (await sqlite_store.list_tasks()).tasks}
    finally:
        await sqlite_store.close()
    assert report.expired == 2
    assert states == {"scan": State.RETRY_WAIT, "once": State.TIMED_OUT}
    (finished,) = [e for e in seen if e.name == "task.finished"]
    assert finished.data["state"] == "timed_out" and finished.data["error"]["code"] == "timeout"
    assert not [e for e in seen if e.name == "task.expired"]
