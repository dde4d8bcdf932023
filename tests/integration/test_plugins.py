"""Plugins through the engine: command plugins in contained process trees, Python plugins by dotted path and
entry point, allow/deny at load and at run, and the network built-ins against loopback servers.

Command plugins are configured the way an operator does it (PluginSpec -> Registry.from_settings) and run
real programs; their processes write "role pid" lines to a file named in the payload, so the test knows
which pids must be gone afterwards without sleeping for them to start.
"""

from __future__ import annotations

import functools
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import anyio
import pytest
from aiohttp import web
from anyio.abc import SocketAttribute

from tidepool.errors import ConfigError
from tidepool.execution.context import TaskContext
from tidepool.execution.resources import ResourcePool
from tidepool.model import AttemptStatus, State, Task
from tidepool.plugins import Plugin, Registry
from tidepool.settings import PluginSpec, PluginsSettings, ResourceSettings, TypeSettings
from tidepool.store.sqlite import SqliteStore

from ..process_trees import RECORD, TREE, gone, pids
from .conftest import GRACE_S, Node, registry_of, running_node

pytestmark = pytest.mark.timeout(60)

PY = sys.executable


ALLOCATE = RECORD + """
record("leader")
blocks = []
for _ in range(256):  # 2 GiB at most, should the watcher not work
    blocks.append(b"x" * (8 << 20))
    time.sleep(0.01)
time.sleep(60)
"""

FLOOD = RECORD + """
record("leader")
chunk = b"y" * 65536
for _ in range(800):  # 50 MiB
    sys.stdout.buffer.write(chunk)
"""


def command(tmp_path: Path, script: str, **spec: object) -> PluginSpec:
    path = tmp_path / f"script-{abs(hash(script))}.py"
    path.write_text(script)
    return PluginSpec(command=(PY, str(path), "{pidfile}"), **spec)


def event_ts(node: Node, task_id: str, name: str) -> float:
    return next(e.ts for e in node.seen if e.name == name and e.data.get("task_id") == task_id)


def error_of(task: Task) -> tuple[str, str]:
    assert task.error is not None
    return task.error.code, task.error.message


# command plugins


async def test_a_command_retried_to_success_has_one_final_result_that_of_the_attempt_that_succeeded(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    script = tmp_path / "flaky.py"
    script.write_text("import json, sys\nn = int(sys.argv[1])\nprint(json.dumps({'attempt': n}))\n"
                      "sys.exit(3 if n == 1 else 0)\n")
    flaky = PluginSpec(command=(PY, str(script), "{attempt}"))
    registry = registry_of({"flaky": flaky}, {"flaky": TypeSettings(plugins=("flaky",))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("flaky", max_attempts=2))
    assert task.state is State.COMPLETED
    assert [(r.payload, r.final) for r in task.results] == [({"attempt": 1}, False), ({"attempt": 2}, True)]
    assert [(a.status, a.exit_status) for a in task.attempts] == [(AttemptStatus.FAILED, 3),
                                                                  (AttemptStatus.SUCCEEDED, 0)]


@pytest.mark.parametrize("stdout", ['{"a": "\\ud800"}', '{"big": 1e999}', "[" * 100000],
                         ids=["lone_surrogate", "overflow_to_inf", "deep_nesting"])
async def test_output_python_parses_but_strict_json_cannot_hold_is_kept_as_text(
        sqlite_store: SqliteStore, tmp_path: Path, stdout: str) -> None:
    out = tmp_path / "out"
    out.write_text(stdout)
    registry = registry_of({"odd": PluginSpec(command=("cat", str(out)))}, {"odd": TypeSettings(plugins=("odd",))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("odd", max_attempts=1))
    assert task.state is State.COMPLETED
    assert [(r.payload, r.final) for r in task.results] == [({"text": stdout}, True)]


async def test_running_out_of_files_fails_the_attempt_naming_nofile_and_keeps_what_the_command_said(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    opener = PluginSpec(command=(PY, "-c", "import os; files = [open(os.devnull) for _ in range(64)]"), nofile=16)
    registry = registry_of({"opener": opener}, {"opener": TypeSettings(plugins=("opener",))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("opener", max_attempts=1))
    assert task.state is State.FAILED and error_of(task)[0] == "limit_exceeded" and "nofile" in error_of(task)[1]
    (attempt,) = task.attempts
    assert attempt.exit_status == 1 and attempt.stderr_tail is not None and "Too many open files" in attempt.stderr_tail


async def test_a_timed_out_tree_is_gone_within_the_grace_even_setsid_and_sigterm_ignoring_children(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    timeout_s = 1.0
    registry = registry_of({"tree": command(tmp_path, TREE, timeout_s=timeout_s)},
                           {"tree": TypeSettings(plugins=("tree",))})
    pidfile = tmp_path / "pids"
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task_id = await node.submit("tree", {"pidfile": str(pidfile)}, max_attempts=1)
        await node.until(lambda: len(pids(pidfile)) == 4, timeout_s=timeout_s)  # all started before the timeout
        task = await node.finished(task_id)
        assert [role for role, pid in pids(pidfile).items() if not gone(pid)] == []
        took = event_ts(node, task_id, "task.finished") - event_ts(node, task_id, "plugin.started")
    assert task.state is State.TIMED_OUT
    assert error_of(task)[0] == "timeout" and "tree timed out" in error_of(task)[1]
    assert took <= timeout_s + GRACE_S + 1.0
    assert not (tmp_path / "work" / task.attempts[0].id).exists()  # the stop phase removed the workdir



@pytest.mark.parametrize("timeout_in", ["type", "plugin"])
async def test_a_timed_out_command_keeps_its_exit_status_and_stderr_tail_on_the_attempt(
        sqlite_store: SqliteStore, tmp_path: Path, timeout_in: str) -> None:
    """What a hung scanner said before it was killed is what its operator needs most."""
    script = (PY, "-c", "import sys, time; print('scanning 10.0.0.0/8', file=sys.stderr, flush=True); time.sleep(60)")
    spec = PluginSpec(command=script, timeout_s=0.5) if timeout_in == "plugin" else PluginSpec(command=script)
    kind = TypeSettings(plugins=("hung",), timeout_s=0.5) if timeout_in == "type" else TypeSettings(plugins=("hung",))
    registry = registry_of({"hung": spec}, {"hung": kind})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("hung", max_attempts=1))
    assert task.state is State.TIMED_OUT
    (attempt,) = task.attempts
    assert attempt.exit_status == -signal.SIGTERM
    assert attempt.stderr_tail == "scanning 10.0.0.0/8\n"

async def test_memory_past_the_budget_kills_the_tree_and_names_memory_mb(sqlite_store: SqliteStore,
                                                                          tmp_path: Path) -> None:
    registry = registry_of({"hog": command(tmp_path, ALLOCATE, memory_mb=64)}, {"hog": TypeSettings(plugins=("hog",))})
    pidfile = tmp_path / "pids"
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("hog", {"pidfile": str(pidfile)}, max_attempts=2), timeout_s=30)
    assert task.state is State.FAILED
    assert [a.status for a in task.attempts] == [AttemptStatus.FAILED] * 2  # counted and retried like any failure
    for attempt in task.attempts:
        assert attempt.error is not None and attempt.error.code == "limit_exceeded"
        assert attempt.error.message.startswith("memory_mb exceeded")
    assert all(gone(pid) for pid in pids(pidfile).values())


async def test_a_stdout_flood_past_the_blob_limit_kills_the_tree_and_names_max_blob_bytes(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    defs = {"flood": command(tmp_path, FLOOD + "time.sleep(60)\n", max_output_kb=64)}
    registry = Registry.from_settings(PluginsSettings(defs=defs), {"flood": TypeSettings(plugins=("flood",))},
                                      kill_grace_s=GRACE_S, max_blob_bytes=1 << 20)
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("flood", {"pidfile": str(tmp_path / "pids")}, max_attempts=1))
    assert task.state is State.FAILED
    code, message = error_of(task)
    assert code == "limit_exceeded" and message.startswith("max_blob_bytes exceeded")
    assert all(gone(pid) for pid in pids(tmp_path / "pids").values())


async def test_a_payload_value_starting_with_a_dash_is_refused_before_anything_runs(sqlite_store: SqliteStore,
                                                                                    tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    spec = PluginSpec(command=(PY, "-c", "import pathlib, sys; pathlib.Path(sys.argv[1]).touch()", str(marker),
                               "{target}"))
    registry = registry_of({"scan": spec}, {"scan": TypeSettings(plugins=("scan",))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("scan", {"target": "-oN/etc/cron.d/x"}, max_attempts=3))
    assert task.state is State.FAILED
    code, message = error_of(task)
    assert code == "invalid_argument" and "payload.target" in message
    assert len(task.attempts) == 1  # not retried
    assert not marker.exists()
    assert not (tmp_path / "work").exists()  # not even a work directory was made


async def test_cancel_kills_the_running_tree_and_releases_the_slot(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    registry = registry_of({"tree": command(tmp_path, TREE)},
                           {"scan": TypeSettings(plugins=("tree",), required_tags=("nic",))})
    slots = ResourcePool.from_settings({"nic": ResourceSettings(tags=("nic",), count=1)})
    pidfile = tmp_path / "pids"
    async with running_node(sqlite_store, {}, registry=registry, resources=slots, work_root=tmp_path / "work") as node:
        task_id = await node.submit("scan", {"pidfile": str(pidfile)})
        await node.until(lambda: len(pids(pidfile)) == 4)
        assert slots.statistics().resources["nic"].in_use == 1
        # as Daemon.cancel does it: commit the cancel, then fire the attempt's scope
        assert (await node.store.request_cancel(task_id, now=time.time())).state is State.CANCELLING
        held = node.leases.find(task_id)
        assert held is not None
        held.stop("cancel")
        task = await node.finished(task_id)
        assert [role for role, pid in pids(pidfile).items() if not gone(pid)] == []
    assert task.state is State.CANCELLED
    assert [a.status for a in task.attempts] == [AttemptStatus.CANCELLED]
    assert slots.statistics().resources["nic"].in_use == 0


# Python plugins, allow and deny


async def enrich(ctx: TaskContext) -> None:
    ctx.scope["asset"] = {"owner": "blue team", "target": ctx.payload["target"]}


async def report(ctx: TaskContext) -> None:
    await ctx.emit({"seen": ctx.scope["asset"]}, final=True)


async def test_dotted_path_plugins_share_the_scope(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    defs = {"enrich": PluginSpec(python=f"{__name__}:enrich"), "report": PluginSpec(python=f"{__name__}:report")}
    registry = registry_of(defs, {"audit": TypeSettings(plugins=("enrich", "report"))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path) as node:
        task = await node.finished(await node.submit("audit", {"target": "192.0.2.7"}))
    assert task.state is State.COMPLETED
    assert [(r.plugin, r.payload) for r in task.results] == [
        ("report", {"seen": {"owner": "blue team", "target": "192.0.2.7"}})]


def test_a_denied_plugin_is_a_config_error_naming_type_and_plugin_and_is_never_imported() -> None:
    defs = {"enrich": PluginSpec(python="no_such_module_for_tidepool:enrich")}
    types = {"audit": TypeSettings(plugins=("enrich",))}
    with pytest.raises(ConfigError) as caught:
        registry_of(defs, types, deny=("enr*",))
    assert "types.audit" in str(caught.value) and "'enrich'" in str(caught.value)
    assert "denied" in str(caught.value)  # refused before any import was tried
    with pytest.raises(ConfigError, match=r"types\.audit.*'enrich'"):
        registry_of(defs, types, allow=("report",))
    with pytest.raises(ConfigError, match="cannot load"):
        registry_of(defs, types)  # allowed, so imported: and it does not exist


def not_async(ctx: TaskContext) -> None:
    pass


class AsyncCallable:
    async def __call__(self, ctx: TaskContext) -> None:
        pass


async_callable = AsyncCallable()


def _traced(fn: Plugin) -> Plugin:
    @functools.wraps(fn)
    def wrapper(ctx: TaskContext) -> Awaitable[None]:  # a plain function returning the coroutine
        return fn(ctx)
    return wrapper


wrapped = _traced(enrich)


@pytest.mark.parametrize(("module", "function", "refused"), [
    (None, "not_async", "is not an async function"),  # was: every task failed with a TypeError, retried
    ("import sys\nsys.exit(0)\n", "f", "cannot load .*SystemExit: 0"),  # was: config check and run ended 0
    (None, "async_callable", None),
    (None, "wrapped", None),  # a tracing decorator's wrapper, made with functools.wraps
    (None, "enrich", None),
])
def test_a_python_plugin_must_be_an_async_function_whose_module_imports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str | None, function: str,
        refused: str | None) -> None:
    name = __name__
    if module is not None:
        (tmp_path / "tidepool_test_exits.py").write_text(module)
        monkeypatch.syspath_prepend(str(tmp_path))
        name = "tidepool_test_exits"
    defs = {"p": PluginSpec(python=f"{name}:{function}")}
    types = {"t": TypeSettings(plugins=("p",))}
    if refused is None:
        assert registry_of(defs, types).plugins_for("t")[0].name == "p"
        return
    with pytest.raises(ConfigError, match=rf"plugins\.p\.python: .*{refused}"):
        registry_of(defs, types)


def test_an_unknown_plugin_is_a_config_error_naming_type_and_plugin() -> None:
    with pytest.raises(ConfigError, match=r"types\.audit\.plugins: unknown plugin 'nosuch'"):
        registry_of({}, {"audit": TypeSettings(plugins=("noop", "nosuch"))})


def test_the_generic_command_plugin_must_be_configured() -> None:
    with pytest.raises(ConfigError, match=r"types\.run_anything.*\[plugins\.command\]"):
        registry_of({}, {"run_anything": TypeSettings(plugins=("command",))})
    registry = registry_of({"command": PluginSpec(command=(PY, "-c", "print(1)"))},
                           {"run_fixed": TypeSettings(plugins=("command",))})
    assert [p.name for p in registry.plugins_for("run_fixed")] == ["command"]


def test_entry_point_plugins_load_unless_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "tidepool_test_plugins-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tidepool-test-plugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[tidepool.plugins]\nep_enrich = {__name__}:enrich\nep_broken = no_such_module_for_tidepool:x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = registry_of({}, {"audit": TypeSettings(plugins=("ep_enrich",))})
    assert registry.plugins_for("audit")[0].run is enrich
    with pytest.raises(ConfigError, match=r"types\.broken\.plugins: cannot load entry point 'ep_broken'"):
        registry_of({}, {"broken": TypeSettings(plugins=("ep_broken",))})
    with pytest.raises(ConfigError, match="denied"):
        registry_of({}, {"broken": TypeSettings(plugins=("ep_broken",))}, deny=("ep_*",))


async def test_a_plugin_denied_while_the_task_runs_fails_it_with_plugin_denied(sqlite_store: SqliteStore,
                                                                              tmp_path: Path) -> None:
    gate = anyio.Event()

    async def first(ctx: TaskContext) -> None:
        await gate.wait()

    types = {"audit": TypeSettings(plugins=("first", "report"))}
    async with running_node(sqlite_store, {"first": first, "report": report}, types=types,
                            work_root=tmp_path) as node:
        task_id = await node.submit("audit", max_attempts=3)
        await node.until(lambda: "plugin.started" in node.names(task_id))
        node.engine.registry.set_policy(deny=("rep*",))  # the operator's new policy reaches a running attempt
        gate.set()
        task = await node.finished(task_id)
    assert task.state is State.FAILED
    code, message = error_of(task)
    assert code == "plugin_denied" and "'report'" in message and "'audit'" in message
    assert len(task.attempts) == 1 and task.results == ()


# network built-ins


@pytest.fixture
async def web_server() -> AsyncIterator[str]:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello", headers={"X-Probe": "yes"})

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}/"
    finally:
        await runner.cleanup()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens once it is closed


async def test_tcp_connect_reports_open_and_closed_ports_of_a_loopback_target(sqlite_store: SqliteStore,
                                                                               tmp_path: Path) -> None:
    registry = registry_of({}, {"ports": TypeSettings(plugins=("tcp_connect",))})
    shut = closed_port()
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener, \
            running_node(sqlite_store, {}, registry=registry, work_root=tmp_path) as node:
        port = listener.extra(SocketAttribute.local_port)
        task = await node.finished(await node.submit("ports", {"target": "127.0.0.1", "ports": [port, shut]}))
    assert task.state is State.COMPLETED
    [result] = task.results
    assert result.plugin == "tcp_connect" and result.final
    assert result.payload["ports"] == {str(port): "open", str(shut): "closed"}
    assert result.payload["open"] == [port]


async def test_http_probe_reports_status_and_headers_of_a_loopback_server(sqlite_store: SqliteStore,
                                                                          tmp_path: Path, web_server: str) -> None:
    registry = registry_of({}, {"web": TypeSettings(plugins=("http_probe",))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path) as node:
        task = await node.finished(await node.submit("web", {"url": web_server}))
    assert task.state is State.COMPLETED
    [result] = task.results
    assert result.payload["status"] == 200 and result.payload["headers"]["x-probe"] == "yes"
    assert result.payload["tls"] is None and result.payload["final_url"] == web_server
