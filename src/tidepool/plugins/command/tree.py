"""A command's process tree: finding all of it, adding up what it uses, and killing it so that nothing is left.

The tree is the child's process group, every descendant seen alive, and every process whose environment
carries TIDEPOOL_RUN, a cookie unique to the run: a daemon that double-forks out of the group and is orphaned
between two looks is found by it. A process that clears its environment can still escape. The cookie starts
with a mark of the node's work root, so that when the daemon was SIGKILLed the next one finds the trees its
commands left running, and kills them (kill_leftover_runs).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

import anyio
import psutil  # type: ignore[import-untyped]

from .processes import PROCESSES, Seen, Snapshot, live_process, running, send, stat

_GONE_POLL_S = 0.02  # how often a dying tree is looked at
_hurry_by = float("-inf")  # monotonic: a kill under way then has its grace cut short there (see hurry)


def hurry(by: float) -> None:
    """Every kill that is under way, or starts, before monotonic `by` gets its SIGKILL by then whatever its
    grace: the node is fencing itself, and another node may take its tasks soon after. Kills that start
    later have their whole grace again."""
    global _hurry_by
    _hurry_by = by
_MAX_FREEZE_ROUNDS = 50


class ProcessTree:
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
        self.known: dict[Seen, psutil.Process] = {}
        self._cookie = cookie
        with contextlib.suppress(OSError):  # a quick command may already be reaped
            seen = (pid, stat(pid)[1])
            if (proc := live_process(seen)) is not None:
                self.known[seen] = proc

    def refresh(self, snapshot: Snapshot) -> int:
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
            self._discover(await PROCESSES.taken_since(time.monotonic()))  # killing needs the table as it is now
            self._signal_all(signal.SIGTERM)
            started = time.monotonic()
            # Descendants are not our children: no event tells us when they exit, so look.
            while self._alive() and not _grace_over(started, grace_s):  # noqa: ASYNC110
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
                send(proc, signal.SIGSTOP)
            if not self._discover(await PROCESSES.taken_since(time.monotonic())):
                return

    def _signal_all(self, sig: signal.Signals) -> None:
        # A group id is not reused while any member lives (and not until pids wrap after that).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)
        for proc in self._alive():  # the ones that left the group
            send(proc, sig)

    def _discover(self, snapshot: Snapshot) -> bool:
        """Add every process carrying the cookie and every descendant of a known live process, as `snapshot`
        saw them, to `known`; True if any was new."""
        # The dead have no more to tell.
        self.known = {seen: proc for seen, proc in self.known.items() if running(proc)}
        count = len(self.known)
        carriers = snapshot.carriers.get(self._cookie, [])
        for seen in [*carriers, *snapshot.descendants([*self.known, *carriers])]:
            # Not a zombie: its frozen parent cannot reap it, and it would count as new at every look.
            if seen not in self.known and (proc := live_process(seen)) is not None and running(proc):
                self.known[seen] = proc
        return len(self.known) > count

    def _alive(self) -> list[psutil.Process]:
        return [proc for proc in self.known.values() if running(proc)]


def kill_leftover_runs(work_root: Path) -> int:
    """SIGKILL every process the commands of an earlier daemon on `work_root` left running; return how many.

    For the start of a daemon, before any command of its own runs: one that was SIGKILLed (no systemd to
    empty its cgroup) leaves its commands' trees running, orphaned, and a task run again beside its old
    self would use twice what exists once (a licence). Their cookies carry the work root's mark, wherever
    they went. SIGKILL at once: no one is left whom a grace would serve. Blocking: run it in a worker thread.
    """
    mark = f"{node_mark(work_root)}."
    # A daemon started from one of the node's own commands carries the mark too: never itself, nor its parents.
    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    doomed: dict[Seen, psutil.Process] = {}
    for _ in range(_MAX_FREEZE_ROUNDS):
        snapshot = PROCESSES.scan_since(time.monotonic())
        carriers = [seen for cookie, carrying in snapshot.carriers.items() if cookie.startswith(mark)
                    for seen in carrying]
        new = {}
        for seen in [*carriers, *snapshot.descendants(carriers)]:
            if seen not in doomed and seen[0] not in spared and (proc := live_process(seen)) is not None \
                    and running(proc):
                new[seen] = proc
        if not new:
            break
        for proc in new.values():  # stopped, they cannot fork: look again until no new one turns up
            send(proc, signal.SIGSTOP)
        doomed.update(new)
    for proc in doomed.values():
        send(proc, signal.SIGKILL)
    return len(doomed)


def node_mark(work_root: Path) -> str:
    """What a run's cookie starts with: the same for every run of a node, whatever its daemon process."""
    return hashlib.sha256(os.fsencode(os.path.abspath(work_root))).hexdigest()[:16]


def _grace_over(started: float, grace_s: float) -> bool:
    now = time.monotonic()
    return now >= started + grace_s or started <= _hurry_by <= now

