"""Running one external command for a command plugin, and nothing it starts outliving it.

The runner owns the child process's whole life: it starts it (spawn, confined as its plugin says), watches its
output (output: stdout spooled whole to a file, which may not pass max_stdout_bytes), the RSS and CPU budget of
its whole process tree (tree) and its work directory's disk (disk),
and kills that tree - on a breached limit, on cancellation (timeouts and cancels arrive that way) and after a
normal exit, so that nothing the command left behind keeps running. What the exit status means, retries and
results belong to the caller.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio

from ...errors import LimitExceeded, PluginError
from .disk import DiskWatch
from .output import Capture, CommandResult, StdoutSpool
from .processes import PROCESSES, RUN_COOKIE
from .spawn import NOT_CONFINED, Confinement, rlimits, spawn
from .spawn import _spawn_failed as spawn_failed
from .tree import ProcessTree, node_mark

CLEANUP_SLACK_S = 5.0  # cleanup may take kill_grace_s plus this, never longer


@dataclass(frozen=True)
class CommandLimits:
    memory_mb: int | None = None
    cpu_s: float | None = None
    nofile: int | None = None
    max_output_kb: int = 10240  # of stdout in the result; the rest only in the spool
    disk_mb: int | None = None
    max_stdout_bytes: int | None = None  # the spool's cap: artifacts.max_blob_bytes, the most a blob may hold


async def run_command(
    argv: list[str],
    *,
    env: dict[str, str],
    workdir: Path,
    limits: CommandLimits,
    kill_grace_s: float,
    poll_interval_s: float = 0.2,
    on_end: Callable[[int | None, str], None] = lambda exit_status, stderr_tail: None,
    confinement: Confinement = NOT_CONFINED,
) -> CommandResult:
    """Run argv in its own session; a non-zero exit is a result, a breached limit a LimitExceeded.
    `on_end` hears the exit status and stderr tail however the run ended: a timeout or a cancel arrives as
    a cancellation, and a breach as an exception, and the operator wants both on the attempt all the same.
    `workdir` is the attempt's, in the node's work root (Engine: work_root/attempt_id): the run's cookie
    carries the work root's mark (see kill_leftover_runs)."""
    capture = Capture()
    try:
        spool = StdoutSpool(workdir)
    except OSError as exc:  # out of descriptors or disk, as a spawn would be: retried alike
        raise spawn_failed(argv[0], exc) from exc
    # What marks this run's processes, wherever they went (see ProcessTree), and whose run it is.
    cookie = f"{node_mark(workdir.parent)}.{secrets.token_hex(16)}"
    try:
        # Shielded so an anyio cancel cannot strike between fork and the cleanup below owning the tree.
        with anyio.CancelScope(shield=True):
            transport = await spawn(argv, capture, env={**env, RUN_COOKIE: cookie}, workdir=workdir,
                                    limits=rlimits(cpu_s=limits.cpu_s, nofile=limits.nofile), stdout=spool.fd,
                                    confinement=confinement)
        tree = ProcessTree(transport.get_pid(), cookie=cookie)
        disk = None if limits.disk_mb is None else DiskWatch(workdir, cap_mb=limits.disk_mb,
                                                             interval_s=poll_interval_s)
        breach: LimitExceeded | None = None
        try:
            breach = await _supervise(capture, spool, tree, limits, disk, poll_interval_s=poll_interval_s)
        finally:
            await _end(transport, capture, tree, kill_grace_s=kill_grace_s)
            on_end(transport.get_returncode(), capture.stderr.decode(errors="replace"))
        exit_status = _exit_status(argv[0], transport.get_returncode(), tree, limits, breach)
        return await capture.result(exit_status, spool, stdout_cap=limits.max_output_kb * 1024)
    finally:
        spool.close()


async def _end(
    transport: asyncio.SubprocessTransport, capture: Capture, tree: ProcessTree, *, kill_grace_s: float
) -> None:
    """Exit, breach or cancellation alike: nothing the command started may outlive it."""
    deadline = anyio.current_time() + kill_grace_s + CLEANUP_SLACK_S
    with anyio.CancelScope(shield=True, deadline=deadline):
        await tree.kill(grace_s=kill_grace_s)
        await capture.closed.wait()  # reaped, and all its pipes at their end
    transport.close()


def _exit_status(
    program: str, exit_status: int | None, tree: ProcessTree, limits: CommandLimits, breach: LimitExceeded | None,
) -> int:
    """The exit status of a run that breached no limit."""
    if breach is not None:
        raise breach
    if exit_status is None:
        raise PluginError(f"{program} did not exit after SIGKILL", code="unkillable")
    if _cpu_limit_hit(exit_status, tree, limits):
        raise LimitExceeded("cpu_s", f"{program} used its {limits.cpu_s} s of CPU")
    return exit_status


def ran_out_of_files(result: CommandResult) -> bool:
    """Whether a failed command says what EMFILE says: RLIMIT_NOFILE makes the breach itself impossible, so
    a program fails opening one file more, and says so (ENFILE's "... in system" is the host, not us)."""
    return result.exit_status != 0 and re.search(_EMFILE, result.stderr_tail) is not None


_EMFILE = re.escape(os.strerror(errno.EMFILE)) + "(?! in system)"


async def _supervise(
    capture: Capture, spool: StdoutSpool, tree: ProcessTree, limits: CommandLimits, disk: DiskWatch | None, *,
    poll_interval_s: float,
) -> LimitExceeded | None:
    """Wait for the child to exit; return the limit it breached first, if any."""
    memory_cap = None if limits.memory_mb is None else limits.memory_mb * 2**20
    while True:
        exited = capture.exited  # first: all it wrote before it exited is in the spool by the look below
        # Looked at once a poll: what it writes within one interval may pass the cap before it is seen.
        if limits.max_stdout_bytes is not None and spool.size() > limits.max_stdout_bytes:
            return LimitExceeded("max_blob_bytes", f"stdout passed {limits.max_stdout_bytes} bytes, the most a "
                                 "blob may hold ([artifacts] max_blob_bytes)")
        if exited:  # what it wrote last counts too, however quickly it exited
            return await _disk_breach(disk, force=True)
        if (breach := await _disk_breach(disk)) is not None:
            return breach
        # A snapshot up to one interval old will do: whoever took it, it was taken for all (see ProcessTable).
        rss = tree.refresh(await PROCESSES.taken_since(time.monotonic() - poll_interval_s))
        if memory_cap is not None and rss > memory_cap:
            return LimitExceeded("memory_mb", f"the process tree used {rss >> 20} MiB of {limits.memory_mb}")
        if limits.cpu_s is not None and tree.cpu_s >= limits.cpu_s:  # RLIMIT_CPU counts each process alone
            return LimitExceeded("cpu_s", f"the process tree used {tree.cpu_s:.1f} s of CPU, over {limits.cpu_s}")
        with anyio.move_on_after(poll_interval_s):
            await capture.wake.wait()


async def _disk_breach(disk: DiskWatch | None, *, force: bool = False) -> LimitExceeded | None:
    if disk is None or not await disk.over(now=time.monotonic(), force=force):
        return None
    return LimitExceeded("disk_mb", f"the work directory used {disk.used >> 20} MiB of {disk.cap_mb}")


def _cpu_limit_hit(exit_status: int, tree: ProcessTree, limits: CommandLimits) -> bool:
    if limits.cpu_s is None:
        return False
    if exit_status == -signal.SIGXCPU:
        return True
    # Past the hard limit the kernel sends SIGKILL; only the CPU time we saw tells it from others.
    return exit_status == -signal.SIGKILL and tree.leader_cpu_s >= limits.cpu_s
