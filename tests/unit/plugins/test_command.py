"""Command plugin runner: real subprocesses, real signals, real rlimits.

Children report readiness by writing "role pid" lines to a file in their workdir, so no test
sleeps to let a child start; the same files tell the test which pids must be gone afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import psutil  # type: ignore[import-untyped]
import pytest
import uvloop

from tests.process_trees import RECORD, gone, pids
from tidepool.errors import InvalidArgument, LimitExceeded, PluginError
from tidepool.plugins.command import (
    CommandLimits,
    CommandResult,
    hurry,
    ran_out_of_files,
    render_argv,
    run_command,
    runner,
    scrubbed_env,
    spawn,
)
from tidepool.plugins.command.template import input_names, template_values

pytestmark = pytest.mark.timeout(20)

PY = sys.executable
GRACE_S = 0.5
POLL_S = 0.05


# leader -> middle -> {escaper (calls setsid), sleeper}; all sleep forever.
TREE = (
    RECORD
    + """
def escaper():
    os.setsid()  # leaves the process group: killpg alone cannot reach it
    sleep_forever("escaper")
def middle():
    fork(escaper)
    fork(lambda: sleep_forever("sleeper"))
    sleep_forever("middle")
fork(middle)
sleep_forever("leader")
"""
)

IGNORE_TERM = (
    RECORD
    + """
import signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
record("leader")
time.sleep(60)
"""
)

# The allocation happens in a forked child: the budget is the whole tree's, not the leader's.
ALLOCATE = (
    RECORD
    + """
record("leader")
if os.fork() == 0:
    record("allocator")
    blocks = []
    for _ in range(256):  # 2 GiB at most, should the watcher not work
        blocks.append(b"x" * (8 << 20))
        time.sleep(0.01)
    time.sleep(60)
os.wait()
"""
)

FLOOD = (
    RECORD
    + """
record("leader")
chunk = b"y" * 65536
for _ in range(800):  # 50 MiB
    sys.stdout.buffer.write(chunk)
"""
)

FLOOD_FOREVER = (
    RECORD
    + """
record("leader")
chunk = b"y" * 65536
while True:
    sys.stdout.buffer.write(chunk)
"""
)

LEAVES_BACKGROUND = (
    RECORD
    + """
import json, subprocess
record("leader")
# Inherits stdout: while it lives, the pipe never reaches its end.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(sys.argv[1], "a") as f:
    f.write(f"background {child.pid}\\n")
print(json.dumps({"done": True}))
"""
)

# leader -> middle (setsid, forks the daemon, exits at once) -> daemon: the classic double fork. The middle
# lives too briefly for a poll to see it, and the daemon, in a session of its own, is nobody's descendant.
DAEMONIZE = (
    RECORD
    + """
import json
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        record("daemon")  # keeps the leader's stdout, as a careless daemon does
        os.close(w)
        while True:
            time.sleep(3600)
    os._exit(0)
os.close(w)
os.read(r, 1)  # end of file: the middle has exited and the daemon has recorded itself
"""
)


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "child.py"
    path.write_text(body)
    return [PY, str(path), str(tmp_path / "pids")]


def _pids(tmp_path: Path) -> dict[str, int]:
    return pids(tmp_path / "pids")


async def _wait_for_pids(tmp_path: Path, count: int) -> dict[str, int]:
    with anyio.fail_after(5):
        while True:
            if len(pids := _pids(tmp_path)) >= count:
                return pids
            await anyio.sleep(0.01)


async def _assert_gone_by(pids: dict[str, int], deadline: float) -> None:
    while True:
        alive = {role: pid for role, pid in pids.items() if not gone(pid)}
        if not alive or anyio.current_time() >= deadline:
            break
        await anyio.sleep(0.01)
    for pid in alive.values():  # a failed test leaves nothing running
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert alive == {}


async def _run(argv: list[str], tmp_path: Path, **limits: Any) -> CommandResult:
    return await run_command(
        argv,
        env=scrubbed_env({}),
        workdir=tmp_path,
        limits=CommandLimits(**limits),
        kill_grace_s=GRACE_S,
        poll_interval_s=POLL_S,
    )


# --- render_argv ---------------------------------------------------------------------------


def test_render_substitutes_names_and_leaves_literals_alone() -> None:
    template = ["nmap", "-oX", "-", "-p{port}", "{target}", "{workdir}/out-{task_id}-{attempt}", "{{x}}"]
    values = {"target": "10.0.0.1", "port": 443, "workdir": Path("/w"), "task_id": "t1", "attempt": 2}
    assert render_argv(template, values) == ["nmap", "-oX", "-", "-p443", "10.0.0.1", "/w/out-t1-2", "{x}"]


def test_an_input_renders_as_its_path_and_a_payload_key_cannot_stand_in_for_one() -> None:
    values = template_values({"target": "h", "input:sample": "/etc/shadow"}, task_id="t1", attempt=1,
                             workdir="/w", inputs={"hosts.txt": Path("/w/inputs/hosts.txt")})
    assert render_argv(["wc", "-l", "{input:hosts.txt}", "{target}"], values) == [
        "wc", "-l", "/w/inputs/hosts.txt", "h"]
    with pytest.raises(InvalidArgument) as caught:
        render_argv(["cat", "{input:sample}"], values)
    assert caught.value.field == "inputs.sample"
    assert "its inputs: hosts.txt" in str(caught.value)
    assert input_names(["x", "{input:a}-{input:b.txt}", "{target}"]) == {"a", "b.txt"}


@pytest.mark.parametrize(
    ("template", "values", "field"),
    [
        (["{target}"], {"target": "-oN /etc/cron.d/x"}, "payload.target"),
        (["--host={target}"], {"target": "-x"}, "payload.target"),
        (["{port}"], {"port": -1}, "payload.port"),
        (["{target}"], {"target": "a\x00b"}, "payload.target"),
        (["{target}"], {}, "payload.target"),
        (["{target}"], {"target": None}, "payload.target"),
        (["{task_id}"], {}, "task_id"),
        (["{target}"], {"target": ["a", "b"]}, "payload.target"),
        (["{target}"], {"target": {"a": 1}}, "payload.target"),
        (["{flag}"], {"flag": True}, "payload.flag"),
        (["{target.__class__}"], {"target": "a"}, "command[0]"),
        (["x", "{0}"], {"0": "a"}, "command[1]"),
        (["{target!r}"], {"target": "a"}, "command[0]"),
        (["{target:>9}"], {"target": "a"}, "command[0]"),
        (["{target"], {"target": "a"}, "command[0]"),
        (["{input:sample}"], {"input:other": "/w/inputs/other"}, "inputs.sample"),
        (["{input:}"], {}, "command[0]"),
        (["{input:../x}"], {}, "command[0]"),
        (["{input!r:x}"], {}, "command[0]"),
    ],
)
def test_render_refuses_with_the_field_named(
    template: list[str], values: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        render_argv(template, values)
    assert caught.value.field == field
    assert caught.value.code == "invalid_argument"
    assert caught.value.retryable is False


# --- scrubbed_env ----------------------------------------------------------------------------


def test_scrubbed_env_keeps_only_the_basics_and_the_plugin_env() -> None:
    daemon_env = {
        "PATH": "/usr/bin",
        "HOME": "/var/lib/tidepool",
        "LANG": "C.UTF-8",
        "TZ": "UTC",
        "NOTIFY_SOCKET": "@sd",
        "WATCHDOG_USEC": "1000",
        "WATCHDOG_PID": "1",
        "LISTEN_FDS": "1",
        "CREDENTIALS_DIRECTORY": "/run/cred",
        "TIDEPOOL_X": "1",
        "TIDEPOOL_API__TOKEN": "secret",
        "DATABASE_URL": "postgres://u:p@h/db",
    }
    env = scrubbed_env({"NMAP_PRIVILEGED": "1"}, source=daemon_env)
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/var/lib/tidepool",
        "LANG": "C.UTF-8",
        "TZ": "UTC",
        "NMAP_PRIVILEGED": "1",
    }


def test_scrubbed_env_reads_the_daemon_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/opt/bin:/usr/bin")
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "1000")
    monkeypatch.setenv("TIDEPOOL_X", "1")
    env = scrubbed_env({"EXTRA": "yes"})
    assert env["PATH"] == "/opt/bin:/usr/bin"
    assert env["EXTRA"] == "yes"
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "TIDEPOOL_X"} & env.keys()


# --- results ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stdout", "payload"),
    [
        (b'{"open": [22, 443]}\n', {"open": [22, 443]}),
        (b"[1, 2]", [1, 2]),
        (b"42", 42),
        (b"host is up\n", {"text": "host is up\n"}),
        (b"", {"text": ""}),
        (b"NaN", {"text": "NaN"}),  # Python would parse it; no JSON store could take it back
        (b"\xff\xfe{", {"text": "\ufffd\ufffd{"}),
        # Python parses these too, into what no store can take: a lone surrogate, inf, a stack overflow.
        (b'{"a": "\\ud800"}', {"text": '{"a": "\\ud800"}'}),
        (b'{"big": 1e999}', {"text": '{"big": 1e999}'}),
        (b"[" * 100000, {"text": "[" * 100000}),
    ],
)
def test_result_payload_is_json_or_text(stdout: bytes, payload: object) -> None:
    result = CommandResult(exit_status=0, stdout=stdout, stdout_dropped=0, stderr_tail="", stderr_dropped=0)
    assert result.result_payload() == payload


async def test_stdout_json_env_and_workdir_reach_the_result(tmp_path: Path) -> None:
    code = "import json, os; print(json.dumps({'cwd': os.getcwd(), 'env': dict(os.environ)}))"
    result = await run_command(
        [PY, "-c", code],
        env=scrubbed_env({"PLUGIN_ENV": "1"}, source={"PATH": "/usr/bin", "NOTIFY_SOCKET": "x"}),
        workdir=tmp_path,
        limits=CommandLimits(),
        kill_grace_s=GRACE_S,
    )
    payload = result.result_payload()
    assert isinstance(payload, dict)
    assert result.exit_status == 0
    assert payload["cwd"] == str(tmp_path)
    assert payload["env"]["PLUGIN_ENV"] == "1"
    assert "NOTIFY_SOCKET" not in payload["env"]


async def test_nonzero_exit_is_a_result_with_the_stderr_tail(tmp_path: Path) -> None:
    # 1 MiB of stderr, far more than a pipe holds: it must be drained while the child writes.
    code = "import sys; sys.stderr.write('e' * (1 << 20) + 'the end'); print('partial'); sys.exit(3)"
    result = await _run([PY, "-c", code], tmp_path)
    assert result.exit_status == 3
    assert result.result_payload() == {"text": "partial\n"}
    assert result.stderr_tail.endswith("the end")
    assert len(result.stderr_tail) == 4096
    assert result.stderr_dropped == (1 << 20) + len("the end") - 4096


@pytest.mark.parametrize("limits", [{}, {"nofile": 16, "cpu_s": 1}], ids=["plain", "under_prlimit"])
async def test_a_missing_program_is_a_plugin_error(tmp_path: Path, limits: dict[str, Any]) -> None:
    for program in [str(tmp_path / "no-such-program"), "no-such-program-on-path"]:
        with pytest.raises(PluginError) as caught:
            await _run([program], tmp_path, **limits)
        assert caught.value.code == "spawn_failed"
        assert str(caught.value).startswith(f"cannot start {program!r}: [Errno 2] No such file or directory")


async def test_what_the_command_leaves_running_is_killed_after_it_exits(tmp_path: Path) -> None:
    result = await _run(_script(tmp_path, LEAVES_BACKGROUND), tmp_path)
    assert result.result_payload() == {"done": True}
    await _assert_gone_by(_pids(tmp_path), anyio.current_time() + 1)


async def test_a_daemon_the_command_left_holding_stdout_is_killed_and_the_run_ends_at_once(tmp_path: Path) -> None:
    started = anyio.current_time()
    result = await _run(_script(tmp_path, DAEMONIZE + "print(json.dumps({'done': True}))"), tmp_path)
    took = anyio.current_time() - started
    pids = _pids(tmp_path)
    assert set(pids) == {"daemon"}
    await _assert_gone_by(pids, anyio.current_time() + 1)
    assert result.result_payload() == {"done": True}
    # Its stderr pipe stays open while the daemon lives: were it not found, the run would end only at the cleanup slack.
    assert took < GRACE_S + runner.CLEANUP_SLACK_S


# --- killing the tree ------------------------------------------------------------------------


async def test_timeout_kills_the_whole_tree_even_a_setsid_grandchild(tmp_path: Path) -> None:
    pids: dict[str, int] = {}

    async def observe() -> None:
        pids.update(await _wait_for_pids(tmp_path, 4))
        assert os.getpgid(pids["sleeper"]) == pids["leader"]
        assert os.getpgid(pids["escaper"]) != pids["leader"]  # really left the group

    started = anyio.current_time()
    with pytest.raises(TimeoutError), anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            tg.start_soon(observe)
            await _run(_script(tmp_path, TREE), tmp_path)
    assert set(pids) == {"leader", "middle", "escaper", "sleeper"}
    await _assert_gone_by(pids, started + 1 + GRACE_S + 1)


async def test_timeout_kills_a_daemon_that_double_forked_out_of_the_tree(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError), anyio.fail_after(1):
        await _run(_script(tmp_path, DAEMONIZE + "record('leader'); time.sleep(60)"), tmp_path)
    pids = _pids(tmp_path)
    assert set(pids) == {"daemon", "leader"}
    assert os.getsid(pids["daemon"]) != pids["leader"]  # really out of the leader's session
    await _assert_gone_by(pids, anyio.current_time() + GRACE_S + 1)


async def test_a_child_ignoring_sigterm_is_sigkilled_after_the_grace(tmp_path: Path) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(_run, _script(tmp_path, IGNORE_TERM), tmp_path)
        pids = await _wait_for_pids(tmp_path, 1)
        cancelled_at = anyio.current_time()
        tg.cancel_scope.cancel()
    assert anyio.current_time() - cancelled_at >= GRACE_S * 0.9  # it did get its grace
    await _assert_gone_by(pids, cancelled_at + GRACE_S + 1)


async def test_a_fencing_node_cuts_the_grace_short_and_later_kills_have_it_whole(tmp_path: Path) -> None:
    """A node about to be called gone must be rid of its commands before another node runs their tasks,
    whatever kill_grace_s says; once that moment has passed, a kill gets its whole grace again."""
    long_grace = 8.0
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(run_command, _script(tmp_path, IGNORE_TERM), env=scrubbed_env({}), workdir=tmp_path,
                              limits=CommandLimits(), kill_grace_s=long_grace, poll_interval_s=POLL_S))
        pids = await _wait_for_pids(tmp_path, 1)
        fenced_at = anyio.current_time()
        hurry(time.monotonic() + 0.3)
        tg.cancel_scope.cancel()
    await _assert_gone_by(pids, fenced_at + 2)
    assert anyio.current_time() - fenced_at < long_grace / 2

    (tmp_path / "pids").unlink(missing_ok=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_run, _script(tmp_path, IGNORE_TERM), tmp_path)
        pids = await _wait_for_pids(tmp_path, 1)
        cancelled_at = anyio.current_time()
        tg.cancel_scope.cancel()
    assert anyio.current_time() - cancelled_at >= GRACE_S * 0.9  # the fence is over: the grace is whole


async def test_asyncio_native_timeout_kills_the_child(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5):
            await _run(_script(tmp_path, RECORD + "record('leader'); time.sleep(60)"), tmp_path)
    await _assert_gone_by(_pids(tmp_path), anyio.current_time() + GRACE_S + 1)


# --- limits ----------------------------------------------------------------------------------


async def test_memory_over_budget_kills_the_tree(tmp_path: Path) -> None:
    with pytest.raises(LimitExceeded) as caught:
        await _run(_script(tmp_path, ALLOCATE), tmp_path, memory_mb=64)
    assert caught.value.limit == "memory_mb"
    assert caught.value.code == "limit_exceeded"
    pids = _pids(tmp_path)
    assert set(pids) == {"leader", "allocator"}
    await _assert_gone_by(pids, anyio.current_time() + 1)


async def test_a_stdout_flood_keeps_its_head_for_the_result_and_all_of_it_in_the_spool(tmp_path: Path) -> None:
    me = psutil.Process()
    baseline = me.memory_info().rss
    peak = baseline

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, me.memory_info().rss)
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(sample)
        result = await _run(_script(tmp_path, FLOOD), tmp_path, max_output_kb=1024)
        tg.cancel_scope.cancel()
    assert result.exit_status == 0
    assert result.stdout == b"y" * (1 << 20)
    assert result.stdout_dropped == (50 << 20) - (1 << 20)
    assert result.result_payload() == {"text": "y" * (1 << 20), "truncated": True, "stdout_bytes": 50 << 20}
    assert result.stdout_file == tmp_path / ".tidepool" / "stdout"
    assert result.stdout_file.read_bytes() == b"y" * (50 << 20)
    assert peak - baseline < 20 << 20  # the daemon never held the flood: the child wrote it to the file


async def test_stdout_past_its_cap_kills_the_tree_naming_the_blob_limit(tmp_path: Path) -> None:
    with pytest.raises(LimitExceeded) as caught:
        await _run(_script(tmp_path, FLOOD_FOREVER), tmp_path, max_output_kb=64, max_stdout_bytes=4 << 20)
    assert caught.value.limit == "max_blob_bytes"
    assert caught.value.code == "limit_exceeded"
    await _assert_gone_by(_pids(tmp_path), anyio.current_time() + 1)


async def test_stdout_of_a_quick_exit_past_its_cap_is_a_breach_too(tmp_path: Path) -> None:
    with pytest.raises(LimitExceeded) as caught:
        await _run([PY, "-c", "import sys; sys.stdout.write('y' * 100000)"], tmp_path, max_stdout_bytes=99999)
    assert caught.value.limit == "max_blob_bytes"


async def test_a_link_where_the_spool_goes_is_replaced_never_written_through(tmp_path: Path) -> None:
    # A command of its own user owns the work directory; a second command must not write through its links.
    (tmp_path / ".tidepool").mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / ".tidepool" / "stdout").symlink_to(victim)
    result = await _run([PY, "-c", "print('out')"], tmp_path)
    assert result.stdout == b"out\n"
    assert victim.read_text() == "keep me"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / ".tidepool" / "stdout").unlink()
    (tmp_path / ".tidepool").rmdir()
    (tmp_path / ".tidepool").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PluginError) as caught:
        await _run([PY, "-c", "print('out')"], tmp_path)
    assert (caught.value.code, caught.value.retryable) == ("spawn_failed", False)  # ENOTDIR: it would again
    assert list((tmp_path / "elsewhere").iterdir()) == []


async def test_cpu_time_limit(tmp_path: Path) -> None:
    with pytest.raises(LimitExceeded) as caught:
        await _run([PY, "-c", "while True: pass"], tmp_path, cpu_s=1)
    assert caught.value.limit == "cpu_s"


async def test_cpu_time_limit_when_the_program_ignores_sigxcpu(tmp_path: Path) -> None:
    # The kernel then SIGKILLs it one CPU second later, at the hard limit.
    code = "import signal; signal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    with pytest.raises(LimitExceeded) as caught:
        await _run([PY, "-c", code], tmp_path, cpu_s=1)
    assert caught.value.limit == "cpu_s"


async def test_cpu_time_limit_counts_the_whole_tree(tmp_path: Path) -> None:
    """RLIMIT_CPU gives each process its own budget: three children of 0.7 s each stay under it alone."""
    code = ("import os, time\n"
            "for _ in range(3):\n"
            "    if os.fork() == 0:\n"
            "        end = time.process_time() + 0.7\n"
            "        while time.process_time() < end: pass\n"
            "        os._exit(0)\n"
            "for _ in range(3): os.wait()\n")
    with pytest.raises(LimitExceeded) as caught:
        await _run([PY, "-c", code], tmp_path, cpu_s=1)
    assert caught.value.limit == "cpu_s" and "process tree" in str(caught.value)


async def test_a_child_killed_at_the_cpu_limit_fails_the_attempt_though_its_parent_exits_0(tmp_path: Path) -> None:
    code = ("import os\n"
            "if os.fork() == 0:\n"
            "    while True: pass\n"
            "os.wait()\n")  # the kernel kills the child at the limit; the parent carries on and exits 0
    with pytest.raises(LimitExceeded) as caught:
        await _run([PY, "-c", code], tmp_path, cpu_s=1)
    assert caught.value.limit == "cpu_s"


async def test_time_of_a_grandchild_is_counted_once_when_it_and_its_parent_end_between_two_looks(
        tmp_path: Path) -> None:
    """leader -> shell -> worker: the shell reaps the worker and ends, the leader reaps the shell. The worker's
    0.6 s then sits in the leader's children's time, and must not be counted again as an orphan's."""
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    if os.fork() == 0:\n"
            "        end = time.process_time() + 0.6\n"
            "        while time.process_time() < end: pass\n"
            "        os._exit(0)\n"
            "    os.wait()\n"
            "    os._exit(0)\n"
            "os.wait()\n"
            "time.sleep(1.0)\n")  # long enough for the supervisor to look again
    result = await _run([PY, "-c", code], tmp_path, cpu_s=1)
    assert result.exit_status == 0


async def test_running_out_of_files_under_nofile_is_told_from_other_failures(tmp_path: Path) -> None:
    code = "import os; files = [open(os.devnull) for _ in range(64)]"
    result = await _run([PY, "-c", code], tmp_path, nofile=16)
    assert result.exit_status != 0 and ran_out_of_files(result)
    other = await _run([PY, "-c", "import sys; sys.exit('Too many open files in system')"], tmp_path, nofile=16)
    assert other.exit_status != 0 and not ran_out_of_files(other)  # ENFILE: the host's table, not our limit


SHOW_LIMITS = "(ulimit -Sn; ulimit -Hn; ulimit -St; ulimit -Ht) | /bin/cat"
LIMITS_SHOWN = [b"50", b"50", b"6", b"7"]  # cpu: the backstop a second past cpu_s


@pytest.fixture
def without_prlimit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The daemon's PATH has no prlimit program: commands start through the waiting preexec instead."""
    monkeypatch.setenv("PATH", str(tmp_path))
    spawn._prlimit_program.cache_clear()
    yield
    spawn._prlimit_program.cache_clear()  # found again by the tests that follow


async def _limits_are_in_force_from_the_first_instruction(tmp_path: Path) -> None:
    # sh forks the pipeline at once: limits set on it after it started would mostly miss the subshell.
    for _ in range(20):  # each run a race that setting them late could still win
        result = await _run(["/bin/sh", "-c", SHOW_LIMITS], tmp_path, nofile=50, cpu_s=5)
        assert result.stdout.split() == LIMITS_SHOWN


async def test_rlimits_are_in_force_before_the_command_runs_its_first_instruction(tmp_path: Path) -> None:
    await _limits_are_in_force_from_the_first_instruction(tmp_path)


@pytest.mark.usefixtures("without_prlimit")
async def test_without_prlimit_the_command_waits_until_its_limits_are_set(tmp_path: Path) -> None:
    await _limits_are_in_force_from_the_first_instruction(tmp_path)


@pytest.mark.usefixtures("without_prlimit")
async def test_without_prlimit_a_command_runs_out_of_files_at_nofile_and_the_fallback_is_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    code = "import os; files = [open(os.devnull) for _ in range(64)]"
    results = [await _run([PY, "-c", code], tmp_path, nofile=16) for _ in range(2)]
    assert all(result.exit_status != 0 and ran_out_of_files(result) for result in results)
    assert len([record for record in caplog.records if "prlimit" in record.getMessage()]) == 1


@pytest.mark.usefixtures("without_prlimit")
async def test_without_prlimit_the_command_gets_its_environment_and_stdin_unchanged(tmp_path: Path) -> None:
    """The preexec is a Python program, and Python's start adds LC_CTYPE to its own environment under the C
    locale: the command must see the environment it was given all the same, and /dev/null on stdin."""
    env = {"PATH": "/usr/bin:/bin", "PLUGIN_ENV": "1"}
    result = await run_command(["/usr/bin/env"], env=env, workdir=tmp_path, limits=CommandLimits(nofile=64),
                               kill_grace_s=GRACE_S)
    shown = dict(line.split("=", 1) for line in result.stdout.decode().splitlines())
    assert shown.pop("TIDEPOOL_RUN") and shown == env
    stdin = await _run(["/usr/bin/readlink", "/proc/self/fd/0"], tmp_path, nofile=64)
    assert stdin.stdout == b"/dev/null\n"


@pytest.mark.usefixtures("without_prlimit")
def test_without_prlimit_under_uvloop(tmp_path: Path) -> None:
    """uvloop's pipe to the waiting child is another class than asyncio's: the limits and environment get there."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_limits_are_in_force_from_the_first_instruction(tmp_path))
        runner.run(test_without_prlimit_the_command_gets_its_environment_and_stdin_unchanged(tmp_path))


@pytest.mark.usefixtures("without_prlimit")
async def test_without_prlimit_a_missing_program_is_still_a_spawn_failure(tmp_path: Path) -> None:
    with pytest.raises(PluginError) as caught:
        await _run([str(tmp_path / "no-such-program")], tmp_path, nofile=16)
    assert caught.value.code == "spawn_failed"


# --- uvloop ----------------------------------------------------------------------------------

Scenario = Callable[[Path], Coroutine[Any, Any, None]]


@pytest.mark.parametrize(
    "scenario",
    [
        test_nonzero_exit_is_a_result_with_the_stderr_tail,
        test_what_the_command_leaves_running_is_killed_after_it_exits,
        test_a_daemon_the_command_left_holding_stdout_is_killed_and_the_run_ends_at_once,
        test_timeout_kills_the_whole_tree_even_a_setsid_grandchild,
        test_a_child_ignoring_sigterm_is_sigkilled_after_the_grace,
        test_asyncio_native_timeout_kills_the_child,
        test_memory_over_budget_kills_the_tree,
        test_a_stdout_flood_keeps_its_head_for_the_result_and_all_of_it_in_the_spool,
        test_cpu_time_limit,
    ],
    ids=lambda scenario: scenario.__name__.removeprefix("test_"),
)
def test_under_uvloop(scenario: Scenario, tmp_path: Path) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario(tmp_path))
