"""Running one external command for a command plugin, and nothing it starts outliving it.

This module owns the child process's whole life: the argument list rendered from a template
(values that could be read as options are refused), a scrubbed environment, CPU and open-file
rlimits, bounded capture of stdout and stderr, the RSS budget of the whole process tree, and
killing that tree - on a breached limit, on cancellation (timeouts and cancels arrive that way)
and after a normal exit, so that nothing the command left behind keeps running. What the exit
status means, retries and results belong to the caller.

The tree is the child's process group, every descendant seen alive, and every process whose
environment carries TIDEPOOL_RUN, a cookie unique to the run: a daemon that double-forks out of
the group and is orphaned between two looks is found by it. A process that clears its environment
can still escape. The cookie starts with a mark of the node's work root, so that when the daemon
was SIGKILLed the next one finds the trees its commands left running, and kills them
(kill_leftover_runs). The rlimits are set by util-linux's prlimit program, which execs the command in
the same process, so they bind it and all it forks from its first instruction.

Looking for new processes means reading the whole process table (/proc). That is done by one scan
shared by every running command, at most once per poll interval (a kill asks for a fresh one) and in a
worker thread, and each process's environment is read once in its life: watching costs host processes,
not commands x host processes, and the event loop never waits on the scan (it reads only each tree's own
few processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import json
import logging
import math
import os
import re
import resource
import secrets
import shutil
import signal
import string
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import psutil  # type: ignore[import-untyped]

from tidepool.errors import InvalidArgument, LimitExceeded, PluginError

log = logging.getLogger("tidepool.plugins")

# Placeholders the caller fills in; every other name is a top-level payload field.
_CALLER_FIELDS = frozenset({"task_id", "attempt", "workdir"})
_INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "HOME", "TZ")
_STDERR_TAIL = 4096
_GONE_POLL_S = 0.02  # how often a dying tree is looked at
_CLEANUP_SLACK_S = 5.0  # cleanup may take kill_grace_s plus this, never longer
_MAX_FREEZE_ROUNDS = 50
_RUN_COOKIE = "TIDEPOOL_RUN"
_COOKIE_ENTRY = f"{_RUN_COOKIE}=".encode()
# Exec failures a retry would meet again: no such program, not allowed to run it, not a program, arguments
# too long (E2BIG: one argument over 128 KiB). EAGAIN, ENOMEM, EMFILE and the like pass, and stay retryable.
_SPAWN_FAILS_FOR_GOOD = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG, errno.EACCES,
                                   errno.EPERM, errno.ENOEXEC, errno.E2BIG})
_LITERAL_BRACES = "write {{ and }} for a literal { and }"
_PRLIMIT_OPTIONS = {resource.RLIMIT_CPU: "--cpu", resource.RLIMIT_NOFILE: "--nofile"}
_FORMATTER = string.Formatter()


def render_argv(template: Sequence[str], values: Mapping[str, object]) -> list[str]:
    """Fill `{name}` placeholders of each element; refuse values a program could read as options."""
    return [_render_element(index, element, values) for index, element in enumerate(template)]


def check_template(template: Sequence[str]) -> None:
    """Refuse, with InvalidArgument naming the element, a template no payload could render (checked when the
    config is loaded, so a typo is a config error rather than a failure of every task)."""
    for index, element in enumerate(template):
        _parts(index, element)


def _parts(index: int, element: str) -> list[tuple[str, str | None]]:
    """The element as (literal, placeholder name or None) pairs."""
    where = f"command[{index}]"
    try:
        parts = list(_FORMATTER.parse(element))
    except ValueError as exc:
        raise InvalidArgument(where, f"bad template {element!r}: {exc}; {_LITERAL_BRACES}") from None
    for _, name, spec, conversion in parts:
        # Attribute/index lookups and format specs would let a payload reach into objects.
        if name is not None and (not name.isidentifier() or spec or conversion):
            raise InvalidArgument(where, f"placeholder in {element!r} must be a plain {{name}}; {_LITERAL_BRACES}")
    return [(literal, name) for literal, name, _, _ in parts]


def _render_element(index: int, element: str, values: Mapping[str, object]) -> str:
    out: list[str] = []
    for literal, name in _parts(index, element):
        out.append(literal)
        if name is not None:
            out.append(_template_value(name, values))
    return "".join(out)


def _template_value(name: str, values: Mapping[str, object]) -> str:
    field = name if name in _CALLER_FIELDS else f"payload.{name}"
    value = values.get(name)
    if value is None:
        raise InvalidArgument(field, "no value for this placeholder")
    if isinstance(value, bool) or not isinstance(value, str | int | float | os.PathLike):
        raise InvalidArgument(field, f"a {type(value).__name__} cannot be a command argument")
    text = str(value)
    # shell=False does not stop argument injection: "-oN /etc/cron.d/x" is an option to nmap.
    if text.startswith("-"):
        raise InvalidArgument(field, "a value may not start with '-'")
    if "\x00" in text:
        raise InvalidArgument(field, "a value may not contain NUL")
    return text


def scrubbed_env(extra: Mapping[str, str], *, source: Mapping[str, str] | None = None) -> dict[str, str]:
    """A minimal environment: locale, PATH, HOME and TZ of the daemon, plus the plugin's own `extra`.

    Everything else stays behind - NOTIFY_SOCKET, WATCHDOG_*, LISTEN_*, CREDENTIALS_DIRECTORY,
    TIDEPOOL_*, tokens, DSNs - so a plugin can neither talk to systemd for us nor read our secrets.
    """
    base = os.environ if source is None else source
    env = {key: base[key] for key in _INHERITED_ENV if key in base}
    env.update(extra)
    return env


@dataclass(frozen=True)
class CommandLimits:
    memory_mb: int | None = None
    cpu_s: float | None = None
    nofile: int | None = None
    max_output_kb: int = 10240


@dataclass(frozen=True)
class CommandResult:
    exit_status: int  # negative: killed by that signal
    stdout: bytes  # at most max_output_kb KiB
    stdout_dropped: int
    stderr_tail: str  # the last 4 KiB
    stderr_dropped: int

    def result_payload(self) -> object:
        """stdout parsed as JSON if it is strict JSON, else {"text": stdout}."""
        try:
            value = json.loads(self.stdout)
            # Python's parser takes what no store or client could take back: NaN, 1e999 (inf), a lone
            # surrogate (not UTF-8). Storing it the way the store will is the one test that sees them all.
            json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeError; RecursionError: deep nesting
            return {"text": self.stdout.decode(errors="replace")}
        return value


async def run_command(
    argv: list[str],
    *,
    env: dict[str, str],
    workdir: Path,
    limits: CommandLimits,
    kill_grace_s: float,
    poll_interval_s: float = 0.2,
    on_end: Callable[[int | None, str], None] = lambda exit_status, stderr_tail: None,
) -> CommandResult:
    """Run argv in its own session; a non-zero exit is a result, a breached limit a LimitExceeded.
    `on_end` hears the exit status and stderr tail however the run ended: a timeout or a cancel arrives as
    a cancellation, and a breach as an exception, and the operator wants both on the attempt all the same.
    `workdir` is the attempt's, in the node's work root (Engine: work_root/attempt_id): the run's cookie
    carries the work root's mark (see kill_leftover_runs)."""
    capture = _Capture(stdout_cap=limits.max_output_kb * 1024)
    rlimits = _rlimits(limits)
    prlimit = _prlimit_program() if rlimits else None
    # What marks this run's processes, wherever they went (see _Tree), and whose run it is.
    cookie = f"{_node_mark(workdir.parent)}.{secrets.token_hex(16)}"
    # Shielded so an anyio cancel cannot strike between fork and the cleanup below owning the tree.
    with anyio.CancelScope(shield=True):
        transport = await _spawn(argv, capture, env={**env, _RUN_COOKIE: cookie}, workdir=workdir,
                                 rlimits=rlimits, prlimit=prlimit)
    tree = _Tree(transport.get_pid(), cookie=cookie)
    breach: LimitExceeded | None = None
    try:
        if prlimit is None:  # the fallback: what the command forks before this keeps our limits
            _set_rlimits(tree.pgid, rlimits)
        breach = await _supervise(capture, tree, limits, poll_interval_s=poll_interval_s)
    finally:
        # Exit, breach or cancellation alike: nothing the command started may outlive it.
        deadline = anyio.current_time() + kill_grace_s + _CLEANUP_SLACK_S
        with anyio.CancelScope(shield=True, deadline=deadline):
            await tree.kill(grace_s=kill_grace_s)
            await capture.closed.wait()  # reaped, and both pipes read to the end
        transport.close()
        on_end(transport.get_returncode(), capture.stderr.decode(errors="replace"))
    exit_status = transport.get_returncode()
    if breach is not None:
        raise breach
    if exit_status is None:
        raise PluginError(f"{argv[0]} did not exit after SIGKILL", code="unkillable")
    if _cpu_limit_hit(exit_status, tree, limits):
        raise LimitExceeded("cpu_s", f"{argv[0]} used its {limits.cpu_s} s of CPU")
    return capture.result(exit_status)


def ran_out_of_files(result: CommandResult) -> bool:
    """Whether a failed command says what EMFILE says: RLIMIT_NOFILE makes the breach itself impossible, so
    a program fails opening one file more, and says so (ENFILE's "... in system" is the host, not us)."""
    return result.exit_status != 0 and re.search(_EMFILE, result.stderr_tail) is not None


_EMFILE = re.escape(os.strerror(errno.EMFILE)) + "(?! in system)"


async def _spawn(
    argv: list[str],
    capture: _Capture,
    *,
    env: dict[str, str],
    workdir: Path,
    rlimits: Mapping[int, tuple[int, int]],
    prlimit: str | None,
) -> asyncio.SubprocessTransport:
    # loop.subprocess_exec (what create_subprocess_exec wraps) hands the output to _Capture as it
    # arrives, so nothing is buffered beyond the caps, and gives a transport we may close.
    loop = asyncio.get_running_loop()
    try:
        command = argv if prlimit is None else _under_prlimit(prlimit, argv, rlimits, env=env, workdir=workdir)
        transport, _ = await loop.subprocess_exec(
            lambda: capture,
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=str(workdir),
            env=env,
            start_new_session=True,  # own session and process group; never preexec_fn (threads exist)
        )
    except OSError as exc:
        raise _spawn_failed(argv[0], exc) from exc
    return transport


def _spawn_failed(program: str, exc: OSError) -> PluginError:
    # Retried, a missing program or a payload too long for exec only uses up the attempts, with backoff between.
    return PluginError(f"cannot start {program!r}: {exc}", code="spawn_failed",
                       retryable=exc.errno not in _SPAWN_FAILS_FOR_GOOD)


def _rlimits(limits: CommandLimits) -> dict[int, tuple[int, int]]:
    """The (soft, hard) of each rlimit to set, by resource."""
    wanted = {}
    # Never RLIMIT_AS/RLIMIT_DATA: Go scanners reserve huge address ranges; RSS is watched instead.
    if limits.cpu_s is not None:
        # The supervisor's poll holds the whole tree to cpu_s. RLIMIT_CPU gives each process a budget of its
        # own, so it is only the backstop, a second past cpu_s: at cpu_s itself a child killed by it would
        # leave a parent that may exit 0 before the poll sees the time. SIGXCPU at the soft limit lets a
        # program stop itself; the kernel SIGKILLs a second later.
        soft = max(math.ceil(limits.cpu_s), 1) + 1
        wanted[resource.RLIMIT_CPU] = (soft, soft + 1)
    if limits.nofile is not None:
        wanted[resource.RLIMIT_NOFILE] = (limits.nofile, limits.nofile)
    for which, (soft, hard) in wanted.items():
        _, ours = resource.getrlimit(which)  # the child inherits ours, and cannot raise the hard one
        if ours != resource.RLIM_INFINITY:
            wanted[which] = (min(soft, ours), min(hard, ours))
    return wanted


@functools.cache  # looked up, and the gap told, once per process
def _prlimit_program() -> str | None:
    path = shutil.which("prlimit")
    if path is None:
        log.warning("prlimit (util-linux) not found: cpu_s and nofile are set on a command after it started, "
                    "so what it forks at once keeps the daemon's limits; install util-linux to close the gap")
    return path


def _under_prlimit(
    prlimit: str, argv: list[str], rlimits: Mapping[int, tuple[int, int]], *, env: Mapping[str, str], workdir: Path
) -> list[str]:
    """argv run by prlimit, which sets the limits on itself and execs the program in the same process."""
    # Found first, as exec would (relative to the workdir, on the child's PATH): a missing program fails
    # to start as without prlimit, instead of becoming prlimit's exit status.
    name = os.path.join(workdir, argv[0]) if "/" in argv[0] else argv[0]
    program = shutil.which(name, path=env.get("PATH", os.defpath))
    if program is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
    options = [f"{_PRLIMIT_OPTIONS[which]}={soft}:{hard}" for which, (soft, hard) in rlimits.items()]
    return [prlimit, *options, "--", program, *argv[1:]]


def _set_rlimits(pid: int, rlimits: Mapping[int, tuple[int, int]]) -> None:
    for which, limit in rlimits.items():
        try:
            resource.prlimit(pid, which, limit)
        except ProcessLookupError:
            return  # already gone; its exit status tells the rest


async def _supervise(
    capture: _Capture, tree: _Tree, limits: CommandLimits, *, poll_interval_s: float
) -> LimitExceeded | None:
    """Wait for the child to exit; return the limit it breached first, if any."""
    memory_cap = None if limits.memory_mb is None else limits.memory_mb * 2**20
    while True:
        if capture.stdout_dropped:
            return LimitExceeded("max_output_kb", f"stdout passed {limits.max_output_kb} KiB")
        if capture.exited:
            return None
        # A snapshot up to one interval old will do: whoever took it, it was taken for all (see _ProcessTable).
        rss = tree.refresh(await _PROCESSES.taken_since(time.monotonic() - poll_interval_s))
        if memory_cap is not None and rss > memory_cap:
            return LimitExceeded("memory_mb", f"the process tree used {rss >> 20} MiB of {limits.memory_mb}")
        if limits.cpu_s is not None and tree.cpu_s >= limits.cpu_s:  # RLIMIT_CPU counts each process alone
            return LimitExceeded("cpu_s", f"the process tree used {tree.cpu_s:.1f} s of CPU, over {limits.cpu_s}")
        with anyio.move_on_after(poll_interval_s):
            await capture.wake.wait()


def _cpu_limit_hit(exit_status: int, tree: _Tree, limits: CommandLimits) -> bool:
    if limits.cpu_s is None:
        return False
    if exit_status == -signal.SIGXCPU:
        return True
    # Past the hard limit the kernel sends SIGKILL; only the CPU time we saw tells it from others.
    return exit_status == -signal.SIGKILL and tree.leader_cpu_s >= limits.cpu_s


class _Capture(asyncio.SubprocessProtocol):
    """Keeps the head of stdout and the tail of stderr, however much the child writes."""

    def __init__(self, *, stdout_cap: int) -> None:
        self.stdout_cap = stdout_cap
        self.stdout = bytearray()
        self.stdout_dropped = 0
        self.stderr = bytearray()
        self.stderr_dropped = 0
        self.exited = False
        self.wake = anyio.Event()  # the child exited or stdout overflowed
        self.closed = anyio.Event()  # the child exited and both pipes are at their end

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        # Everything is read as it arrives, so the child never blocks on a full pipe.
        if fd == 1:
            room = max(self.stdout_cap - len(self.stdout), 0)
            self.stdout += data[:room]
            if len(data) > room:
                self.stdout_dropped += len(data) - room
                self.wake.set()
        else:
            self.stderr_dropped += max(len(data) - _STDERR_TAIL, 0)
            self.stderr += data[-_STDERR_TAIL:]
            excess = len(self.stderr) - _STDERR_TAIL
            if excess > 0:
                del self.stderr[:excess]
                self.stderr_dropped += excess

    def process_exited(self) -> None:
        self.exited = True
        self.wake.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    def result(self, exit_status: int) -> CommandResult:
        return CommandResult(
            exit_status=exit_status,
            stdout=bytes(self.stdout),
            stdout_dropped=self.stdout_dropped,
            stderr_tail=self.stderr.decode(errors="replace"),
            stderr_dropped=self.stderr_dropped,
        )


class _Tree:
    """The child's process group plus every descendant seen alive, and every process carrying the run's cookie.

    A grandchild that calls setsid() leaves the group, and once its parent dies it is no longer
    anyone's descendant either; only having seen it earlier, or the cookie in its environment, lets us kill it.
    """

    def __init__(self, pid: int, *, cookie: str) -> None:
        self.pgid = pid  # start_new_session made the child the leader of its own group
        self.leader_cpu_s = 0.0
        self.cpu_s = 0.0  # the whole tree's, as last seen: see refresh()
        self._cpu_seen: dict[int, tuple[float, int | None]] = {}  # pid: (CPU with its reaped children, ppid)
        self._cpu_orphaned = 0.0  # CPU of processes gone with no ancestor of the tree left to account for it
        self.known: dict[_Seen, psutil.Process] = {}
        self._cookie = cookie
        with contextlib.suppress(OSError):  # a quick command may already be reaped
            seen = (pid, _stat(pid)[1])
            if (proc := _process(seen)) is not None:
                self.known[seen] = proc

    def refresh(self, snapshot: _Snapshot) -> int:
        """Look for new descendants and add up the tree's CPU time; return its RSS in bytes.

        A process's CPU counts with its children's once it has reaped them, so the sum over the live
        processes carries the dead ones along (through a parent that died too, into its own parent), except
        those with no live ancestor left to have reaped them: their last-seen time is kept."""
        self._discover(snapshot)
        rss, seen = 0, {}
        for proc in self._alive():
            with contextlib.suppress(psutil.Error), proc.oneshot():  # /proc/<pid>/stat read once for all three
                rss += int(proc.memory_info().rss)
                t = proc.cpu_times()
                seen[proc.pid] = (t.user + t.system + t.children_user + t.children_system, proc.ppid())
                if proc.pid == self.pgid:
                    self.leader_cpu_s = float(t.user + t.system)
        for pid, (cpu, _) in self._cpu_seen.items():
            if pid not in seen and not self._live_ancestor(pid, seen):
                self._cpu_orphaned += cpu
        self._cpu_seen = seen
        self.cpu_s = max(self.cpu_s, self._cpu_orphaned + sum(cpu for cpu, _ in seen.values()))
        return rss

    def _live_ancestor(self, pid: int, alive: Mapping[int, object]) -> bool:
        """Whether a process of the tree last seen above `pid` (by the parents seen at the last refresh) lives."""
        ppid = self._cpu_seen[pid][1]
        while ppid is not None and ppid not in alive and ppid in self._cpu_seen:
            ppid = self._cpu_seen[ppid][1]
        return ppid in alive

    async def kill(self, *, grace_s: float) -> None:
        """SIGTERM the tree, give it grace_s to exit, then SIGKILL it until nothing is left."""
        try:
            self._discover(await _PROCESSES.taken_since(time.monotonic()))  # killing needs the table as it is now
            self._signal_all(signal.SIGTERM)
            with anyio.move_on_after(grace_s):
                # Descendants are not our children: no event tells us when they exit, so look.
                while self._alive():  # noqa: ASYNC110
                    await anyio.sleep(_GONE_POLL_S)
            while True:
                await self._freeze()
                alive = self._alive()
                self._signal_all(signal.SIGKILL)
                if not alive:
                    return
                await anyio.sleep(_GONE_POLL_S)
        finally:  # cut short at an await (the cleanup's deadline): what is known gets its SIGKILL all the same
            self._signal_all(signal.SIGKILL)

    async def _freeze(self) -> None:
        # A stopped process cannot fork, so stop all and look again until no new child turns up;
        # killing a parent first would orphan children we have not seen yet.
        for _ in range(_MAX_FREEZE_ROUNDS):
            for proc in self._alive():
                _send(proc, signal.SIGSTOP)
            if not self._discover(await _PROCESSES.taken_since(time.monotonic())):
                return

    def _signal_all(self, sig: signal.Signals) -> None:
        # A group id is not reused while any member lives (and not until pids wrap after that).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)
        for proc in self._alive():  # the ones that left the group
            _send(proc, sig)

    def _discover(self, snapshot: _Snapshot) -> bool:
        """Add every process carrying the cookie and every descendant of a known live process, as `snapshot`
        saw them, to `known`; True if any was new."""
        # The dead have no more to tell.
        self.known = {seen: proc for seen, proc in self.known.items() if _running(proc)}
        count = len(self.known)
        carriers = snapshot.carriers.get(self._cookie, [])
        for seen in [*carriers, *snapshot.descendants([*self.known, *carriers])]:
            # Not a zombie: its frozen parent cannot reap it, and it would count as new at every look.
            if seen not in self.known and (proc := _process(seen)) is not None and _running(proc):
                self.known[seen] = proc
        return len(self.known) > count

    def _alive(self) -> list[psutil.Process]:
        return [proc for proc in self.known.values() if _running(proc)]


def kill_leftover_runs(work_root: Path) -> int:
    """SIGKILL every process the commands of an earlier daemon on `work_root` left running; return how many.

    For the start of a daemon, before any command of its own runs: one that was SIGKILLed (no systemd to
    empty its cgroup) leaves its commands' trees running, orphaned, and a task run again beside its old
    self would use twice what exists once (a licence). Their cookies carry the work root's mark, wherever
    they went. SIGKILL at once: no one is left whom a grace would serve. Blocking: run it in a worker thread.
    """
    mark = f"{_node_mark(work_root)}."
    # A daemon started from one of the node's own commands carries the mark too: never itself, nor its parents.
    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    doomed: dict[_Seen, psutil.Process] = {}
    for _ in range(_MAX_FREEZE_ROUNDS):
        snapshot = _PROCESSES.scan_since(time.monotonic())
        carriers = [seen for cookie, carrying in snapshot.carriers.items() if cookie.startswith(mark)
                    for seen in carrying]
        new = {}
        for seen in [*carriers, *snapshot.descendants(carriers)]:
            if seen not in doomed and seen[0] not in spared and (proc := _process(seen)) is not None \
                    and _running(proc):
                new[seen] = proc
        if not new:
            break
        for proc in new.values():  # stopped, they cannot fork: look again until no new one turns up
            _send(proc, signal.SIGSTOP)
        doomed.update(new)
    for proc in doomed.values():
        _send(proc, signal.SIGKILL)
    return len(doomed)


def _node_mark(work_root: Path) -> str:
    """What a run's cookie starts with: the same for every run of a node, whatever its daemon process."""
    return hashlib.sha256(os.fsencode(os.path.abspath(work_root))).hexdigest()[:16]


@dataclass(frozen=True)
class WatchStatistics:
    process_table_scans: int  # reads of the whole /proc, for every command together: see _ProcessTable


def statistics() -> WatchStatistics:
    return WatchStatistics(process_table_scans=_PROCESSES.scans)


_Seen = tuple[int, int]  # (pid, start time in clock ticks since boot): a process, which a pid alone is not


@dataclass(frozen=True)
class _Snapshot:
    """The host's processes as one scan saw them."""

    taken: float  # time.monotonic() when the scan began
    children: Mapping[_Seen, list[_Seen]]
    carriers: Mapping[str, list[_Seen]]  # by the TIDEPOOL_RUN in their environment
    cookies: Mapping[_Seen, str | None]  # every process's TIDEPOOL_RUN, read once in its life

    def descendants(self, roots: Iterable[_Seen]) -> list[_Seen]:
        found: dict[_Seen, None] = {}  # ordered, and a visited set: reads of a racing host cannot loop us
        queue = list(roots)
        while queue:
            for child in self.children.get(queue.pop(), ()):
                if child not in found:
                    found[child] = None
                    queue.append(child)
        return list(found)


class _ProcessTable:
    """The latest snapshot of the host's processes, shared by every command's supervisor.

    Scanned per command, each poll read all of /proc once per running command, on the event loop's thread:
    8 commands on a 490-process host held up the loop for most of each second. Here a snapshot serves
    everyone who asks for one no older than it, and the scan runs in a worker thread, one at a time.
    """

    def __init__(self) -> None:
        self.scans = 0
        self.latest = _Snapshot(taken=-math.inf, children={}, carriers={}, cookies={})
        self._lock = threading.Lock()

    async def taken_since(self, since: float) -> _Snapshot:
        """A snapshot begun at or after `since` (time.monotonic()); the loop never waits on /proc for it."""
        latest = self.latest
        if latest.taken >= since:
            return latest
        return await anyio.to_thread.run_sync(self.scan_since, since)

    def scan_since(self, since: float) -> _Snapshot:
        """taken_since, blocking."""
        with self._lock:  # who comes while a scan runs waits for it, and mostly takes its result
            if self.latest.taken < since:
                self.latest = _scan(self.latest)
                self.scans += 1
            return self.latest


_PROCESSES = _ProcessTable()


def _scan(previous: _Snapshot) -> _Snapshot:
    taken = time.monotonic()
    stats = {}
    for pid in psutil.pids():
        with contextlib.suppress(OSError):  # gone since the listing
            stats[pid] = _stat(pid)
    children: defaultdict[_Seen, list[_Seen]] = defaultdict(list)
    carriers: defaultdict[str, list[_Seen]] = defaultdict(list)
    cookies: dict[_Seen, str | None] = {}
    for pid, (ppid, start) in stats.items():
        seen = (pid, start)
        cookie = cookies[seen] = previous.cookies[seen] if seen in previous.cookies else _cookie(pid)
        if ppid in stats:
            children[(ppid, stats[ppid][1])].append(seen)
        if cookie is not None:
            carriers[cookie].append(seen)
    return _Snapshot(taken, children, carriers, cookies)


def _stat(pid: int) -> tuple[int, int]:
    """(parent pid, start time in clock ticks since boot) from one read of /proc/<pid>/stat. psutil's ppid()
    reads it twice (the second for its pid-reuse check) and costs about four times as much per process."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rfind(b")") + 2 :].split()  # after the name, which may hold spaces and parentheses
    return int(fields[1]), int(fields[19])


def _cookie(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:  # another user's process (unreadable, and none of ours), or gone
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(_COOKIE_ENTRY):
            return entry[len(_COOKIE_ENTRY) :].decode(errors="replace")
    return None


def _process(seen: _Seen) -> psutil.Process | None:
    """The process a snapshot saw, if it still runs: its pid may belong to another one by now."""
    pid, start = seen
    try:
        proc = psutil.Process(pid)
        # Read after: a pid holds one process from its birth to its reaping, so the same start then is the same one.
        return proc if _stat(pid)[1] == start else None
    except (psutil.Error, OSError):
        return None


def _running(proc: psutil.Process) -> bool:
    try:  # a zombie has exited; only its parent's wait() is missing
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _send(proc: psutil.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(psutil.Error):  # psutil refuses a pid that was reused meanwhile
        proc.send_signal(sig)
