"""The engine runs each task through its phases and ends it in the state the outcome calls for."""

import asyncio
import contextlib
import gc
import time
from pathlib import Path

import anyio
import pytest

from tidepool.errors import PluginError, StoreUnavailable
from tidepool.execution.context import TaskContext
from tidepool.execution.leases import Held
from tidepool.execution.pool import PoolConfig
from tidepool.http.answers import TaskDetailOut
from tidepool.lifecycle import RetryPolicy
from tidepool.model import AttemptStatus, Claimed, Lease, ResultBatch, State
from tidepool.plugins import Plugin, PluginDef, Registry
from tidepool.settings import TypeSettings
from tidepool.store.port import ResultQuota
from tidepool.store.sqlite import SqliteStore

from .conftest import running_node


async def noop(ctx: TaskContext) -> None:
    pass


async def forever(ctx: TaskContext) -> None:
    await anyio.sleep_forever()


async def test_phases_run_in_order_with_events(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    async with running_node(sqlite_store, {"noop": noop}, work_root=tmp_path) as node:
        task = await node.finished(await node.submit("noop"))
        assert task.state is State.COMPLETED
        assert [a.status for a in task.attempts] == [AttemptStatus.SUCCEEDED]
        assert node.names(task.id) == [
            "task.leased", "task.phase:initialize", "task.phase:prepare", "task.phase:run",
            "plugin.started", "plugin.finished", "task.phase:stop", "task.finished",
        ]


async def test_every_plugin_started_has_its_plugin_finished_saying_how_it_ended(sqlite_store: SqliteStore,
                                                                                tmp_path: Path) -> None:
    async def broken(ctx: TaskContext) -> None:
        raise RuntimeError("scanner crashed")

    plugins = {"noop": PluginDef("noop", noop), "broken": PluginDef("broken", broken),
               "forever": PluginDef("forever", forever), "capped": PluginDef("capped", forever, timeout_s=0.05)}
    types = {"noop": TypeSettings(plugins=("noop",)), "broken": TypeSettings(plugins=("broken",)),
             "slow": TypeSettings(plugins=("forever",), timeout_s=0.1), "capped": TypeSettings(plugins=("capped",))}
    async with running_node(sqlite_store, {}, registry=Registry(plugins, types), work_root=tmp_path) as node:
        ended = {t: await node.finished(await node.submit(t, max_attempts=1)) for t in types}
        outcomes = {t: [(e.name, e.data.get("outcome")) for e in node.seen
                        if e.data.get("task_id") == task.id and e.name.startswith("plugin.")]
                    for t, task in ended.items()}
    # a plugin that returned, raised, overran its own timeout, or was stopped with its attempt (here by
    # the run phase's deadline; a cancel, a lost lease or a shutdown stop it the same way)
    assert outcomes == {t: [("plugin.started", None), ("plugin.finished", outcome)] for t, outcome in
                        (("noop", "succeeded"), ("broken", "failed"), ("capped", "timed_out"), ("slow", "stopped"))}


async def test_scope_enrichment_and_results_reach_the_store(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    async def first(ctx: TaskContext) -> None:
        ctx.scope["seen"] = ctx.payload["n"] * 2
        ctx.progress(0.5, "halfway")

    async def second(ctx: TaskContext) -> None:
        await ctx.emit({"double": ctx.scope["seen"]}, final=True)

    types = {"two": TypeSettings(plugins=("first", "second"))}
    async with running_node(sqlite_store, {"first": first, "second": second}, types=types,
                            work_root=tmp_path) as node:
        task = await node.finished(await node.submit("two", {"n": 21}))
        assert task.state is State.COMPLETED
        assert [(r.plugin, r.payload, r.final) for r in task.results] == [("second", {"double": 42}, True)]



@pytest.mark.parametrize("result", [{"x": float("inf")}, {"x": float("nan")}, {"x": {1, 2}}], ids=["inf", "nan", "set"])
async def test_a_result_that_is_not_json_fails_the_plugin_naming_it_and_is_not_stored(
        sqlite_store: SqliteStore, tmp_path: Path, result: object) -> None:
    async def odd(ctx: TaskContext) -> None:
        await ctx.emit(result, final=True)

    async with running_node(sqlite_store, {"odd": odd}, work_root=tmp_path) as node:
        task = await node.finished(await node.submit("odd", max_attempts=3))
        assert task.state is State.FAILED and len(task.attempts) == 1, "a plugin bug: retrying cannot help"
        assert task.error is not None and task.error.code == "invalid_argument"
        assert task.error.message.startswith("result: not JSON"), task.error
        assert not task.results


async def test_a_task_retried_to_success_shows_one_final_result_per_plugin_that_of_its_successful_attempt(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    runs = 0

    async def scan(ctx: TaskContext) -> None:
        await ctx.emit({"ports": [22]}, final=True)

    async def report(ctx: TaskContext) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("report server away")
        await ctx.emit({"sent": True}, final=True)

    types = {"scan": TypeSettings(plugins=("scan", "report"))}
    async with running_node(sqlite_store, {"scan": scan, "report": report}, types=types, work_root=tmp_path,
                            policy=RetryPolicy(base_s=0.01, max_s=0.01, jitter=0.0)) as node:
        task = await node.finished(await node.submit("scan", max_attempts=2))
    assert task.state is State.COMPLETED
    failed, succeeded = (a.id for a in task.attempts)
    shown = TaskDetailOut.of(task).to_json()["results"]
    assert [(r["plugin"], r["attempt_id"], r["final"]) for r in shown] == [
        ("scan", failed, False), ("scan", succeeded, True), ("report", succeeded, True)]


class ResultsAway:
    """The real store, whose result writes fail as a refused connection would until `back_at` (monotonic)."""

    def __init__(self, store: SqliteStore, away_s: float) -> None:
        self._store = store
        self.back_at = time.monotonic() + away_s
        self.refused = 0

    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float,
                            quota: ResultQuota | None = None) -> ResultBatch:
        if time.monotonic() < self.back_at:
            self.refused += 1
            raise StoreUnavailable("connection refused")
        return await self._store.record_result(lease, batch, now=now, quota=quota)

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)


async def test_a_store_outage_within_the_lease_costs_a_result_write_a_wait_not_the_attempt(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    async def scan(ctx: TaskContext) -> None:
        await ctx.emit({"ports": [22]}, final=True)

    away = ResultsAway(sqlite_store, away_s=1.2)
    async with running_node(away, {"scan": scan}, work_root=tmp_path) as node:  # type: ignore[arg-type]
        task = await node.finished(await node.submit("scan", max_attempts=1))
    assert away.refused >= 2
    assert task.state is State.COMPLETED, task.error
    assert [(r.plugin, r.payload, r.final) for r in task.results] == [("scan", {"ports": [22]}, True)]

async def test_a_finished_task_shows_its_last_progress_report(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    async def reports(ctx: TaskContext) -> None:  # ends long before the lease keeper's next flush
        ctx.progress(0.5, "halfway")
        ctx.progress(1.0, "done")

    async with running_node(sqlite_store, {"reports": reports}, work_root=tmp_path) as node:
        task = await node.finished(await node.submit("reports"))
    assert (task.state, task.progress) == (State.COMPLETED, {"fraction": 1.0, "message": "done"})


async def test_a_result_key_of_the_plugin_is_its_task_s_not_shared_with_other_tasks(sqlite_store: SqliteStore,
                                                                                     tmp_path: Path) -> None:
    acks = []

    async def keyed(ctx: TaskContext) -> None:
        acks.append(await ctx.emit({"task": ctx.task.id}, key="port-80"))
        acks.append(await ctx.emit({"task": ctx.task.id}, key="port-80"))  # sent again: acknowledged, once
        acks.append(await ctx.emit({"done": True}, final=True, key="final"))

    async with running_node(sqlite_store, {"keyed": keyed}, work_root=tmp_path) as node:
        first = await node.finished(await node.submit("keyed"))
        second = await node.finished(await node.submit("keyed"))
    for task in (first, second):
        assert task.state is State.COMPLETED
        assert [(r.payload, r.sequence, r.final, r.idempotency_key) for r in task.results] == [
            ({"task": task.id}, 0, False, f"{task.id}:port-80"), ({"done": True}, 1, True, f"{task.id}:final")]
    assert acks[3].payload == {"task": second.id}, "the second task's emit was stored, not taken for the first's"


async def test_a_python_plugin_s_work_directory_goes_with_its_attempt_and_its_log_lines_name_the_task(
        sqlite_store: SqliteStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    made: list[Path] = []

    async def writes(ctx: TaskContext) -> None:
        workdir = Path(ctx.workdir)
        workdir.mkdir(parents=True)
        (workdir / "scan.xml").write_text("<scan/>")
        made.append(workdir)
        ctx.log.info("wrote %s", "scan.xml")

    with caplog.at_level("INFO", logger="tidepool.plugin"):
        async with running_node(sqlite_store, {"writes": writes}, work_root=tmp_path) as node:
            task = await node.finished(await node.submit("writes"))
    assert task.state is State.COMPLETED and made and not made[0].exists(), "left behind: only commands' went"
    (line,) = [r for r in caplog.records if r.name == "tidepool.plugin"]
    assert line.getMessage() == f"task {task.id} plugin writes: wrote scan.xml"  # the text format shows this
    assert (line.task_id, line.plugin) == (task.id, "writes")  # type: ignore[attr-defined]  # JSON's fields


async def test_run_phase_timeout_ends_timed_out(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    types = {"slow": TypeSettings(plugins=("forever",), timeout_s=0.1)}
    async with running_node(sqlite_store, {"forever": forever}, types=types, work_root=tmp_path) as node:
        task = await node.finished(await node.submit("slow"))
        assert task.state is State.TIMED_OUT
        assert task.error is not None and task.error.code == "timeout"
        assert [a.status for a in task.attempts] == [AttemptStatus.TIMED_OUT]
        assert "task.phase:stop" in node.names(task.id)


async def stubborn(ctx: TaskContext) -> None:
    """Swallows every cancellation (a broad `except BaseException`, a retry wrapper) and returns."""
    for _ in range(3):
        with contextlib.suppress(BaseException):
            await anyio.sleep(0.1)


@pytest.mark.parametrize("deadline", ["run phase", "plugin"])
async def test_a_plugin_that_swallows_its_timeout_and_returns_still_timed_out(sqlite_store: SqliteStore,
                                                                              tmp_path: Path, deadline: str) -> None:
    plugins = {"stubborn": PluginDef("stubborn", stubborn, timeout_s=0.05 if deadline == "plugin" else None)}
    types = {"stubborn": TypeSettings(plugins=("stubborn",), timeout_s=0.05 if deadline == "run phase" else None)}
    async with running_node(sqlite_store, {}, registry=Registry(plugins, types), work_root=tmp_path) as node:
        task = await node.finished(await node.submit("stubborn", max_attempts=1))
        plugin_ended = [e.data["outcome"] for e in node.seen
                        if e.data.get("task_id") == task.id and e.name == "plugin.finished"]
    assert task.state is State.TIMED_OUT
    assert [a.status for a in task.attempts] == [AttemptStatus.TIMED_OUT]
    assert plugin_ended == ["stopped" if deadline == "run phase" else "timed_out"]


async def turns_its_stop_into_an_error(ctx: TaskContext) -> None:
    try:
        await anyio.sleep(1)
    except BaseException:
        raise RuntimeError("stopped; said my own way") from None


@pytest.mark.parametrize("plugin", [stubborn, turns_its_stop_into_an_error])
@pytest.mark.parametrize("why", ["interrupt", "cancel", "lost"])
async def test_an_attempt_stopped_under_a_plugin_that_hides_it_ends_as_its_stop_says(
        sqlite_store: SqliteStore, tmp_path: Path, why: str, plugin: Plugin) -> None:
    """Not completed, failed nor timed out (the plugin's own timeout passes while it hides the stop): an
    interrupted attempt uses no attempt, a cancelled one ends cancelled, a lost lease writes nothing."""
    registry = Registry({"hider": PluginDef("hider", plugin, timeout_s=0.05)},
                        {"hider": TypeSettings(plugins=("hider",))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path) as node:
        task_id = await node.submit("hider", max_attempts=1)
        await node.until(lambda: "plugin.started" in node.names(task_id))
        if why == "cancel":
            await node.store.request_cancel(task_id, now=time.time())
        node.pool.stop_claiming()  # an interrupted task goes back to the queue: not to be run again here
        held = node.leases.find(task_id)
        assert held is not None
        held.stop(why)
        await node.until(lambda: node.leases.held() == [])  # its outcome written, or (lost) given up
        task = await node.store.get(task_id)
    ended = [e.data["outcome"] for e in node.seen if e.name == "plugin.finished" and e.data["task_id"] == task_id]
    assert ended == ["stopped"]
    if why == "lost":  # nothing written: its end is for whoever expires the lease
        assert task.state.active and task.attempts[0].status in (AttemptStatus.LEASED, AttemptStatus.RUNNING)
    else:
        assert (task.state, task.attempts[0].status) == {"interrupt": (State.PENDING, AttemptStatus.INTERRUPTED),
                                                         "cancel": (State.CANCELLED, AttemptStatus.CANCELLED)}[why]


class _NotAnException(BaseException):
    pass


async def exits(ctx: TaskContext) -> None:
    raise SystemExit(3)  # a library's sys.exit()


async def interrupts(ctx: TaskContext) -> None:
    raise KeyboardInterrupt


async def raises_a_base_exception(ctx: TaskContext) -> None:
    raise _NotAnException("of its own")


async def awaits_what_it_cancelled(ctx: TaskContext) -> None:
    helper = asyncio.ensure_future(asyncio.sleep(10))
    await asyncio.sleep(0)
    helper.cancel()
    await helper  # CancelledError, though nobody cancelled the attempt


@pytest.mark.parametrize(("plugin", "named"), [(exits, "SystemExit: 3"), (interrupts, "KeyboardInterrupt raised"),
                                               (raises_a_base_exception, "_NotAnException: of its own"),
                                               (awaits_what_it_cancelled, "CancelledError")])
async def test_what_a_plugin_raises_that_is_no_exception_fails_its_attempt_not_the_pool(
        sqlite_store: SqliteStore, tmp_path: Path, plugin: Plugin, named: str) -> None:
    config = PoolConfig(min_workers=2, max_workers=2, poll_interval_s=0.5)
    async with running_node(sqlite_store, {"bad": plugin, "noop": noop}, pool=config, work_root=tmp_path) as node:
        bad = await node.finished(await node.submit("bad", max_attempts=1))
        after = await node.finished(await node.submit("noop"))  # the pool still runs tasks
        workers = node.pool.statistics().workers
    assert bad.state is State.FAILED and bad.error is not None, bad
    assert (bad.error.code, named in bad.error.message) == ("plugin_error", True), bad.error
    assert after.state is State.COMPLETED and workers == 2


async def test_a_stray_cancellation_while_the_attempt_s_stop_waits_behind_a_shield_ends_it_as_the_stop_says(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    async def stray_under_a_shield(ctx: TaskContext) -> None:
        with anyio.CancelScope(shield=True):  # the attempt's cancel cannot be delivered in here
            helper = asyncio.ensure_future(asyncio.sleep(10))
            await asyncio.sleep(0.3)
            helper.cancel()
            await helper  # CancelledError: not the attempt's, which is still pending

    config = PoolConfig(min_workers=2, max_workers=2, poll_interval_s=0.5)
    async with running_node(sqlite_store, {"stray": stray_under_a_shield, "noop": noop}, pool=config,
                            work_root=tmp_path) as node:
        task_id = await node.submit("stray", max_attempts=1)
        await node.until(lambda: "plugin.started" in node.names(task_id))
        await node.store.request_cancel(task_id, now=time.time())
        held = node.leases.find(task_id)
        assert held is not None
        held.stop("cancel")
        task = await node.finished(task_id)
        after = await node.finished(await node.submit("noop"))
        workers = node.pool.statistics().workers
    assert (task.state, task.attempts[0].status) == (State.CANCELLED, AttemptStatus.CANCELLED)
    assert after.state is State.COMPLETED and workers == 2  # no worker ended with the stray


async def test_a_timeout_is_retried_when_the_type_says_so(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    types = {"slow": TypeSettings(plugins=("forever",), timeout_s=0.05, retry_on_timeout=True)}
    async with running_node(sqlite_store, {"forever": forever}, types=types, work_root=tmp_path) as node:
        task = await node.finished(await node.submit("slow", max_attempts=2))
        assert task.state is State.TIMED_OUT
        assert [a.status for a in task.attempts] == [AttemptStatus.TIMED_OUT] * 2


async def test_an_exception_is_retried_then_fails(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    async def broken(ctx: TaskContext) -> None:
        raise RuntimeError("scanner crashed")

    async with running_node(sqlite_store, {"broken": broken}, work_root=tmp_path) as node:
        task = await node.finished(await node.submit("broken", max_attempts=3))
        assert task.state is State.FAILED
        assert [a.status for a in task.attempts] == [AttemptStatus.FAILED] * 3
        assert task.error is not None and "scanner crashed" in task.error.message
        assert node.names(task.id).count("task.retry_scheduled") == 2


async def test_retry_waits_for_the_backoff(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    async def broken(ctx: TaskContext) -> None:
        raise RuntimeError("flaky")

    policy = RetryPolicy(base_s=60.0, jitter=0.0)
    async with running_node(sqlite_store, {"broken": broken}, policy=policy, work_root=tmp_path) as node:
        task_id = await node.submit("broken")
        await node.until(lambda: "task.retry_scheduled" in node.names(task_id))
        task = await node.store.get(task_id)
        assert task.state is State.RETRY_WAIT
        assert task.available_at - task.attempts[0].finished_at == pytest.approx(60.0, abs=0.01)  # type: ignore


async def test_a_non_retryable_plugin_error_fails_at_once(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    async def refuses(ctx: TaskContext) -> None:
        raise PluginError("target is not allowed", code="forbidden_target", retryable=False)

    async with running_node(sqlite_store, {"refuses": refuses}, work_root=tmp_path) as node:
        task = await node.finished(await node.submit("refuses"))
        assert task.state is State.FAILED
        assert task.error is not None and task.error.code == "forbidden_target"
        assert len(task.attempts) == 1


async def test_cancel_while_running_runs_the_stop_phase_and_ends_cancelled(sqlite_store: SqliteStore,
                                                                          tmp_path: Path) -> None:
    stopped = anyio.Event()

    async def watched(ctx: TaskContext) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stopped.set()

    async with running_node(sqlite_store, {"watched": watched}, renew_every_s=0.05, lease_s=1.0,
                            work_root=tmp_path) as node:
        task_id = await node.submit("watched")
        await node.until(lambda: "plugin.started" in node.names(task_id))
        # the cancel lands in the store only, as from another node; the next renewal notices it
        assert (await node.store.request_cancel(task_id, now=time.time())).state is State.CANCELLING
        task = await node.finished(task_id)
        assert stopped.is_set()
        assert task.state is State.CANCELLED
        assert [a.status for a in task.attempts] == [AttemptStatus.CANCELLED]
        assert node.names(task_id)[-2:] == ["task.phase:stop", "task.finished"]


async def test_a_lost_lease_stops_the_plugin_and_its_late_outcome_is_rejected(sqlite_store: SqliteStore,
                                                                             tmp_path: Path) -> None:
    release = anyio.Event()

    async def slow(ctx: TaskContext) -> None:
        await release.wait()

    async with running_node(sqlite_store, {"slow": slow}, renew_every_s=30.0, lease_s=60.0,
                            work_root=tmp_path) as node:
        task_id = await node.submit("slow", max_attempts=1)
        await node.until(lambda: "plugin.started" in node.names(task_id))
        # another node's reconciler decides this lease is gone (as after a long pause of this node)
        await node.store.expire_leases(now=time.time() + 120, policy=RetryPolicy())
        release.set()
        task = await node.finished(task_id)
        assert task.state is State.FAILED  # the expiry stands; the late success was rejected
        assert [a.status for a in task.attempts] == [AttemptStatus.EXPIRED]


async def test_a_finished_attempt_leaves_no_reference_cycle_behind(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    """Everything an attempt built is freed when it ends, not at the cycle collector's next pass (which,
    with thousands of attempts a second, cost the event loop ~12% of its time)."""
    async def progressing(ctx: TaskContext) -> None:
        ctx.progress(0.5, "halfway")
        await ctx.emit({"ok": True}, final=True)

    async with running_node(sqlite_store, {"progressing": progressing}, work_root=tmp_path) as node:
        await node.finished(await node.submit("progressing"))  # warm up: first-use caches are not garbage
        gc.collect()
        gc.disable()
        try:
            for _ in range(5):
                task = await node.finished(await node.submit("progressing"))
                assert task.state is State.COMPLETED
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            cyclic = [type(o).__name__ for o in gc.garbage if isinstance(o, TaskContext | Held | Claimed)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert cyclic == []
