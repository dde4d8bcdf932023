"""Watching and killing command trees at scale and across a daemon's death, and what a command that cannot
start or a template with braces tells the operator.

Real programs throughout. Their processes write "role pid" lines to a file named on their command line, so
the test knows which pids must be gone (or must not be) without sleeping for them to start. A daemon killed
with SIGKILL is a real one: a Python process running run_command, killed by the test.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import anyio
import anyio.abc
import psutil  # type: ignore[import-untyped]
import pytest

from tidepool.errors import ConfigError
from tidepool.execution.workdirs import clear_leftovers
from tidepool.model import State
from tidepool.plugins import command
from tidepool.plugins.command import CommandLimits, run_command, scrubbed_env, spawn
from tidepool.settings import PluginSpec
from tidepool.store.sqlite import SqliteStore

from ..process_trees import RECORD, gone, pids
from .conftest import GRACE_S, registry_of, running_node

pytestmark = pytest.mark.timeout(60)

PY = sys.executable

# leader -> child; both sleep.
PAIR = RECORD + """
fork(lambda: sleep_forever("child"))
sleep_forever("leader")
"""

# leader -> {child, unmarked (the same program again, its environment emptied: no cookie, only a parent),
# middle (setsid, forks the escaper, exits: the classic double fork; the escaper is init's child then)}.
LEFT_RUNNING = RECORD + """
if sys.argv[2:] == ["unmarked"]:
    sleep_forever("unmarked")
if os.fork() == 0:
    os.setsid()
    fork(lambda: sleep_forever("escaper"))
    os._exit(0)
os.wait()
fork(lambda: os.execve(sys.executable, [sys.executable, sys.argv[0], sys.argv[1], "unmarked"], {}))
fork(lambda: sleep_forever("child"))
sleep_forever("leader")
"""

# A daemon, as far as a command is concerned: runs argv[2:] in the work directory argv[1] with run_command.
DAEMON = """
import sys
from pathlib import Path
import anyio
from tidepool.plugins.command import CommandLimits, run_command, scrubbed_env, spawn
async def main() -> None:
    workdir = Path(sys.argv[1])
    workdir.mkdir(parents=True)
    await run_command(sys.argv[2:], env=scrubbed_env({}), workdir=workdir, limits=CommandLimits(), kill_grace_s=1.0)
anyio.run(main)
"""

# run_command with every file descriptor the process may have in use already: its pipes cannot be made.
OUT_OF_FILES = """
import json, os, resource, sys
from pathlib import Path
import anyio
from tidepool.errors import PluginError
from tidepool.plugins.command import CommandLimits, run_command
async def main() -> None:
    open_now = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        await run_command([sys.executable], env={}, workdir=Path(sys.argv[1]), limits=CommandLimits(),
                          kill_grace_s=1.0)
    except PluginError as exc:
        print(json.dumps([exc.code, exc.retryable, str(exc)]))
anyio.run(main)
"""


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


async def until(condition: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():
            await anyio.sleep(0.01)


def kill_all(*pid_files: Path) -> None:
    """A test leaves nothing running, passed or failed."""
    for path in pid_files:
        for pid in pids(path).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# one scan of the process table for every command


async def test_commands_running_at_once_share_one_scan_of_the_process_table_per_poll_interval(
        tmp_path: Path) -> None:
    commands, poll_s, watch_s = 6, 0.05, 1.0
    program = script(tmp_path, "pair.py", PAIR)
    pid_files = [tmp_path / f"pids-{i}" for i in range(commands)]
    try:
        async with anyio.create_task_group() as tg:
            for pid_file in pid_files:
                tg.start_soon(partial(run_command, [PY, str(program), str(pid_file)], env=scrubbed_env({}),
                                      workdir=tmp_path, limits=CommandLimits(), kill_grace_s=GRACE_S,
                                      poll_interval_s=poll_s))
            await until(lambda: all(len(pids(path)) == 2 for path in pid_files))
            before, started = command.statistics().process_table_scans, time.monotonic()
            await anyio.sleep(watch_s)  # the supervisors poll meanwhile: what they cost is counted
            scans = command.statistics().process_table_scans - before
            watched_s = time.monotonic() - started
            tg.cancel_scope.cancel()
        # One scan per command and poll would be about commands * watched_s / poll_s: 120, not 22.
        assert 1 <= scans <= watched_s / poll_s + 2
        # and the trees were still found, and killed, whole
        assert [pid for path in pid_files for pid in pids(path).values() if not gone(pid)] == []
    finally:
        kill_all(*pid_files)


# what a daemon killed with SIGKILL left running


async def start_daemon(work_root: Path, program: Path, pid_file: Path) -> anyio.abc.Process:
    return await anyio.open_process([PY, "-c", DAEMON, str(work_root / "01-attempt"), PY, str(program),
                                     str(pid_file)], stdin=None, stdout=None, stderr=None)


async def test_a_restarted_node_kills_what_its_killed_daemon_left_running_and_spares_other_nodes_commands(
        sqlite_store: SqliteStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root_a, root_b = tmp_path / "work" / "node-a", tmp_path / "work" / "node-b"
    pids_a, pids_b = tmp_path / "pids-a", tmp_path / "pids-b"
    daemons = []
    try:
        daemons.append(await start_daemon(root_a, script(tmp_path, "tree.py", LEFT_RUNNING), pids_a))
        daemons.append(await start_daemon(root_b, script(tmp_path, "lone.py", RECORD + "sleep_forever('lone')"),
                                          pids_b))
        await until(lambda: len(pids(pids_a)) == 4 and len(pids(pids_b)) == 1)
        for daemon in daemons:
            daemon.kill()  # SIGKILL: no cleanup of its own, and no systemd to empty its cgroup
            await daemon.wait()
        left = pids(pids_a)
        assert [role for role, pid in left.items() if gone(pid)] == []  # the tree outlived its daemon
        assert os.getsid(left["escaper"]) != left["leader"]  # really out of the leader's session
        assert psutil.Process(left["unmarked"]).environ() == {}  # really without the cookie

        caplog.set_level(logging.INFO, logger="tidepool.engine")
        await clear_leftovers(root_a)  # node A starts again

        await until(lambda: all(gone(pid) for pid in left.values()), timeout_s=5.0)
        assert not gone(pids(pids_b)["lone"])  # node B's command is not node A's to kill
        assert list(root_a.iterdir()) == []
        assert [r.getMessage() for r in caplog.records if r.name == "tidepool.engine"] == [
            "killed 4 processes of commands left running by an earlier process",  # before the directories
            "cleared 1 work directories left by an earlier process",
        ]
    finally:
        for daemon in daemons:
            with contextlib.suppress(ProcessLookupError):
                daemon.kill()
        kill_all(pids_a, pids_b)


# a program that cannot start


@pytest.mark.parametrize("cause", ["ENOENT", "EACCES", "ENOEXEC", "E2BIG"])
async def test_a_program_that_cannot_start_fails_its_task_at_once_without_using_its_other_attempts(
        sqlite_store: SqliteStore, tmp_path: Path, cause: str) -> None:
    not_executable = script(tmp_path, "not-executable.py", "print('hello')\n")
    not_a_program = script(tmp_path, "not-a-program", "this is no program\n")
    not_a_program.chmod(0o755)
    program = {"ENOENT": tmp_path / "no-such-program", "EACCES": not_executable, "ENOEXEC": not_a_program,
               "E2BIG": Path(PY)}[cause]
    value = "x" * 200_000 if cause == "E2BIG" else "x"  # one argument may hold 128 KiB
    registry = registry_of({"start": PluginSpec(command=(str(program), "-c", "pass", "{value}"))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("start", {"value": value}, max_attempts=3))
    assert task.state is State.FAILED
    assert len(task.attempts) == 1  # of 3: not retried
    assert task.error is not None and task.error.code == "spawn_failed"
    assert os.strerror(getattr(errno, cause)) in task.error.message


async def test_a_program_that_could_not_start_for_want_of_file_descriptors_may_be_retried(tmp_path: Path) -> None:
    ran = await anyio.run_process([PY, "-c", OUT_OF_FILES, str(tmp_path)])
    code, retryable, message = json.loads(ran.stdout)
    assert (code, retryable) == ("spawn_failed", True)
    assert os.strerror(errno.EMFILE) in message


@pytest.mark.parametrize(("cause", "retryable"), [
    (errno.EAGAIN, True), (errno.ENOMEM, True), (errno.EMFILE, True), (errno.ENFILE, True),
    (errno.ENOENT, False), (errno.EACCES, False), (errno.ENOEXEC, False), (errno.E2BIG, False),
], ids=errno.errorcode.get)
def test_only_the_spawn_failures_a_retry_may_get_past_are_retryable(cause: int, retryable: bool) -> None:
    """What the host cannot make for us now (processes, memory, descriptors) it may later; the rest it never will."""
    error = spawn._spawn_failed("nmap", OSError(cause, os.strerror(cause)))
    assert (error.code, error.retryable) == ("spawn_failed", retryable)


# braces in a template


@pytest.mark.parametrize(("argument", "why"), [
    ("BEGIN {print 1}", "placeholder in 'BEGIN {print 1}' must be a plain {name} or {input:NAME}"),
    ("BEGIN {", "bad template 'BEGIN {': Single '{' encountered in format string"),
])
def test_a_literal_brace_in_a_command_is_a_config_error_that_says_how_to_write_one(argument: str, why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        registry_of({"count": PluginSpec(command=("awk", argument))})
    assert str(caught.value) == f"config: plugins.count.command[1]: {why}; write {{{{ and }}}} for a literal {{ and }}"


async def test_doubled_braces_reach_the_program_as_single_ones(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    registry = registry_of({"count": PluginSpec(command=("awk", "BEGIN {{print 1}}"))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("count", max_attempts=1))
    assert task.state is State.COMPLETED
    assert [r.payload for r in task.results] == [1]  # awk printed "1", which is JSON
