"""Starting a command's process: a scrubbed environment, its own session, and rlimits, network namespace and
user that bind it from its first instruction.

They are set in the child before the command's program is exec'd in the same process, so they bind it and all
it forks. For rlimits alone util-linux's prlimit program does that. Otherwise (no prlimit, or a network
namespace or a user to switch to) the child starts as a small Python program, the launcher, that waits on a
pipe for its instructions and environment, carries them out, and execs the command; it needs nothing beyond
Python. Never preexec_fn: the daemon has threads, and a forked child may deadlock on a lock one of them held.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import math
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from ...errors import PluginError

log = logging.getLogger("tidepool.plugins")

Rlimits = Mapping[int, tuple[int, int]]  # (soft, hard) by resource

_INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "HOME", "TZ")
# Exec failures a retry would meet again: no such program, not allowed to run it, not a program, arguments
# too long (E2BIG: one argument over 128 KiB). EAGAIN, ENOMEM, EMFILE and the like pass, and stay retryable.
_SPAWN_FAILS_FOR_GOOD = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG, errno.EACCES,
                                   errno.EPERM, errno.ENOEXEC, errno.E2BIG})
_PRLIMIT_OPTIONS = {resource.RLIMIT_CPU: "--cpu", resource.RLIMIT_NOFILE: "--nofile"}
PROBE_TIMEOUT_S = 10.0  # how long the launcher may take to say whether it can make a network namespace
# The child's first program when prlimit will not do: the launcher. Its instructions and environment come by
# the pipe on its stdin: Python's own start may add to its environment (LC_CTYPE, under the C locale), and an
# argument list is there for every user of the host to read. Until they have come, the command has not started.
# A network namespace: CLONE_NEWNET, with CLONE_NEWUSER for a daemon that is not root (a user namespace of
# its own, where it is the same uid and may bring its loopback up); loopback up by SIOCGIFFLAGS/SIOCSIFFLAGS.
# The user last: making the namespace and lowering limits need the privileges it gives up.
_LAUNCHER = """\
import json, os, resource, sys
given = json.loads(sys.stdin.buffer.read())
def own_network():
    import ctypes, fcntl, socket, struct
    uid, gid = os.geteuid(), os.getegid()
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000 if uid == 0 else 0x50000000) != 0:
        raise OSError(ctypes.get_errno(), "unshare: " + os.strerror(ctypes.get_errno()))
    if uid != 0:
        for name, line in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(line)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))
try:
    if given["network_none"]:
        own_network()
except OSError as exc:
    sys.exit(f"cannot make a network namespace of its own: {exc}")
for which, soft, hard in given["rlimits"]:
    resource.setrlimit(which, (soft, hard))
if given["uid"] is not None:
    try:
        os.setgroups([given["gid"]])
        os.setgid(given["gid"])
        os.setuid(given["uid"])
    except OSError as exc:
        sys.exit(f"cannot switch to uid {given['uid']}: {exc}")
if given["probe"]:
    sys.exit(0)
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
try:
    os.execve(sys.argv[1], sys.argv[1:], given["env"])
except OSError as exc:
    sys.exit(f"cannot start {sys.argv[1]!r}: {exc}")
"""


@dataclass(frozen=True)
class RunAs:
    """An unprivileged user and its group, as a command runs under them."""

    name: str
    uid: int
    gid: int
    home: str  # the command's HOME: the daemon's own is no place for it


@dataclass(frozen=True)
class Confinement:
    """What the launcher sets up beyond rlimits: a network namespace with loopback only, and a user."""

    network_none: bool = False
    run_as: RunAs | None = None

    @property
    def needed(self) -> bool:
        return self.network_none or self.run_as is not None


NOT_CONFINED = Confinement()


def scrubbed_env(extra: Mapping[str, str], *, source: Mapping[str, str] | None = None) -> dict[str, str]:
    """A minimal environment: locale, PATH, HOME and TZ of the daemon, plus the plugin's own `extra`.

    Everything else stays behind - NOTIFY_SOCKET, WATCHDOG_*, LISTEN_*, CREDENTIALS_DIRECTORY,
    TIDEPOOL_*, tokens, DSNs - so a plugin can neither talk to systemd for us nor read our secrets.
    """
    base = os.environ if source is None else source
    env = {key: base[key] for key in _INHERITED_ENV if key in base}
    env.update(extra)
    return env


def rlimits(*, cpu_s: float | None, nofile: int | None) -> dict[int, tuple[int, int]]:
    """The (soft, hard) of each rlimit to set, by resource."""
    wanted = {}
    # Never RLIMIT_AS/RLIMIT_DATA: Go scanners reserve huge address ranges; RSS is watched instead.
    if cpu_s is not None:
        # The supervisor's poll holds the whole tree to cpu_s. RLIMIT_CPU gives each process a budget of its
        # own, so it is only the backstop, a second past cpu_s: at cpu_s itself a child killed by it would
        # leave a parent that may exit 0 before the poll sees the time. SIGXCPU at the soft limit lets a
        # program stop itself; the kernel SIGKILLs a second later.
        soft = max(math.ceil(cpu_s), 1) + 1
        wanted[resource.RLIMIT_CPU] = (soft, soft + 1)
    if nofile is not None:
        wanted[resource.RLIMIT_NOFILE] = (nofile, nofile)
    for which, (soft, hard) in wanted.items():
        _, ours = resource.getrlimit(which)  # the child inherits ours, and cannot raise the hard one
        if ours != resource.RLIM_INFINITY:
            wanted[which] = (min(soft, ours), min(hard, ours))
    return wanted


async def spawn(
    argv: list[str], protocol: asyncio.SubprocessProtocol, *, env: dict[str, str], workdir: Path, limits: Rlimits,
    stdout: int, confinement: Confinement = NOT_CONFINED,
) -> asyncio.SubprocessTransport:
    """Start argv in its own session and process group, in `workdir`, under `limits` and `confinement` from its
    first instruction, its stdout the file descriptor `stdout`; PluginError "spawn_failed" if it cannot start."""
    try:
        if not limits and not confinement.needed:
            return await _exec(argv, protocol, env=env, workdir=workdir, stdin=asyncio.subprocess.DEVNULL,
                               stdout=stdout)
        if not confinement.needed and (prlimit := _prlimit_program()) is not None:
            command = _under_prlimit(prlimit, argv, limits, env=env, workdir=workdir)
            return await _exec(command, protocol, env=env, workdir=workdir, stdin=asyncio.subprocess.DEVNULL,
                               stdout=stdout)
        command = [*launcher_command(), _program(argv[0], env, workdir), *argv[1:]]
        transport = await _exec(command, protocol, env=env, workdir=workdir, stdin=asyncio.subprocess.PIPE,
                                stdout=stdout)
    except OSError as exc:
        raise _spawn_failed(argv[0], exc) from exc
    try:
        _hand_over(transport, launcher_instructions(limits, env, confinement))
    except BaseException:
        transport.kill()  # it would wait for them as long as the pipe is open
        transport.close()
        raise
    return transport


async def _exec(
    command: list[str], protocol: asyncio.SubprocessProtocol, *, env: dict[str, str], workdir: Path, stdin: int,
    stdout: int,
) -> asyncio.SubprocessTransport:
    # loop.subprocess_exec (what create_subprocess_exec wraps) hands stderr to the protocol as it arrives, so
    # nothing is buffered beyond its cap, and gives a transport we may close. stdout goes to its file whole.
    transport, _ = await asyncio.get_running_loop().subprocess_exec(
        lambda: protocol,
        *command,
        stdin=stdin,
        stdout=stdout,
        stderr=asyncio.subprocess.PIPE,
        cwd=str(workdir),
        env=env,
        start_new_session=True,  # own session and process group
    )
    return transport


def launcher_command() -> list[str]:
    """The launcher as a command line: the program it starts, and that program's arguments, follow."""
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER]


def launcher_instructions(limits: Rlimits, env: Mapping[str, str], confinement: Confinement, *,
                          probe: bool = False) -> bytes:
    """What the launcher reads on its stdin; with `probe` it stops short of exec, once all is set up."""
    user = confinement.run_as
    return json.dumps({
        "rlimits": [[which, soft, hard] for which, (soft, hard) in limits.items()], "env": dict(env),
        "network_none": confinement.network_none,
        "uid": None if user is None else user.uid, "gid": None if user is None else user.gid,
        "probe": probe,
    }).encode()


def _hand_over(transport: asyncio.SubprocessTransport, instructions: bytes) -> None:
    """Give the waiting launcher its instructions and environment: it carries them out and execs the command."""
    pipe = cast(asyncio.WriteTransport, transport.get_pipe_transport(0))  # uvloop's is one, unregistered
    pipe.write(instructions)
    pipe.close()  # its end of file: all is there (a child gone meanwhile only leaves the pipe broken)


@functools.cache  # the host's answer does not change while the daemon runs: asked once per process
def network_namespace_failure() -> str:
    """Why a command cannot get a network namespace of its own on this node ('' when it can): the launcher is
    asked to make one, for real, and stop there. Blocking, some tens of milliseconds, once per process."""
    given = launcher_instructions({}, {}, Confinement(network_none=True), probe=True)
    try:
        done = subprocess.run(launcher_command(), input=given, capture_output=True, timeout=PROBE_TIMEOUT_S,
                              check=False, env={})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if done.returncode == 0 else done.stderr.decode(errors="replace").strip()[-300:]


def _spawn_failed(program: str, exc: OSError) -> PluginError:
    # Retried, a missing program or a payload too long for exec only uses up the attempts, with backoff between.
    return PluginError(f"cannot start {program!r}: {exc}", code="spawn_failed",
                       retryable=exc.errno not in _SPAWN_FAILS_FOR_GOOD)


@functools.cache  # looked up, and the fallback told, once per process
def _prlimit_program() -> str | None:
    path = shutil.which("prlimit")
    if path is None:
        log.warning("prlimit (util-linux) not found: a command with cpu_s or nofile starts as a Python program "
                    "that sets them and then execs it, which costs some milliseconds of CPU per command; install "
                    "util-linux to save them")
    return path


def _under_prlimit(prlimit: str, argv: list[str], limits: Rlimits, *, env: Mapping[str, str],
                   workdir: Path) -> list[str]:
    """argv run by prlimit, which sets the limits on itself and execs the program in the same process."""
    options = [f"{_PRLIMIT_OPTIONS[which]}={soft}:{hard}" for which, (soft, hard) in limits.items()]
    return [prlimit, *options, "--", _program(argv[0], env, workdir), *argv[1:]]


def _program(name: str, env: Mapping[str, str], workdir: Path) -> str:
    """The path exec would run for `name` (relative to the workdir, on the child's PATH). Found before the
    child starts: a missing program fails to start, as without a program setting the limits first, instead
    of becoming that program's exit status."""
    path = os.path.join(workdir, name) if "/" in name else name
    program = shutil.which(path, path=env.get("PATH", os.defpath))
    if program is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)
    return program
