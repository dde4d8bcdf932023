"""The host's process table as every command's watcher shares it: one scan of /proc serves them all.

Looking for new processes means reading the whole process table. That is done by one scan shared by every
running command, at most once per poll interval (a kill asks for a fresh one) and in a worker thread, and each
process's environment is read once in its life: watching costs host processes, not commands x host processes,
and the event loop never waits on the scan (it reads only each tree's own few processes).
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import anyio
import psutil  # type: ignore[import-untyped]

RUN_COOKIE = "TIDEPOOL_RUN"  # in the environment of every process of a run: see tree.ProcessTree
_COOKIE_ENTRY = f"{RUN_COOKIE}=".encode()

Seen = tuple[int, int]  # (pid, start time in clock ticks since boot): a process, which a pid alone is not


@dataclass(frozen=True)
class WatchStatistics:
    process_table_scans: int  # reads of the whole /proc, for every command together: see ProcessTable


def statistics() -> WatchStatistics:
    return WatchStatistics(process_table_scans=PROCESSES.scans)


@dataclass(frozen=True)
class Snapshot:
    """The host's processes as one scan saw them."""

    taken: float  # time.monotonic() when the scan began
    children: Mapping[Seen, list[Seen]]
    carriers: Mapping[str, list[Seen]]  # by the TIDEPOOL_RUN in their environment
    cookies: Mapping[Seen, str | None]  # every process's TIDEPOOL_RUN, read once in its life

    def descendants(self, roots: Iterable[Seen]) -> list[Seen]:
        found: dict[Seen, None] = {}  # ordered, and a visited set: reads of a racing host cannot loop us
        queue = list(roots)
        while queue:
            for child in self.children.get(queue.pop(), ()):
                if child not in found:
                    found[child] = None
                    queue.append(child)
        return list(found)


class ProcessTable:
    """The latest snapshot of the host's processes, shared by every command's supervisor.

    Scanned per command, each poll read all of /proc once per running command, on the event loop's thread:
    8 commands on a 490-process host held up the loop for most of each second. Here a snapshot serves
    everyone who asks for one no older than it, and the scan runs in a worker thread, one at a time.
    """

    def __init__(self) -> None:
        self.scans = 0
        self.latest = Snapshot(taken=-math.inf, children={}, carriers={}, cookies={})
        self._lock = threading.Lock()

    async def taken_since(self, since: float) -> Snapshot:
        """A snapshot begun at or after `since` (time.monotonic()); the loop never waits on /proc for it."""
        latest = self.latest
        if latest.taken >= since:
            return latest
        return await anyio.to_thread.run_sync(self.scan_since, since)

    def scan_since(self, since: float) -> Snapshot:
        """taken_since, blocking."""
        with self._lock:  # who comes while a scan runs waits for it, and mostly takes its result
            if self.latest.taken < since:
                self.latest = _scan(self.latest)
                self.scans += 1
            return self.latest


PROCESSES = ProcessTable()


def _scan(previous: Snapshot) -> Snapshot:
    taken = time.monotonic()
    stats = {}
    for pid in psutil.pids():
        with contextlib.suppress(OSError):  # gone since the listing
            stats[pid] = stat(pid)
    children: defaultdict[Seen, list[Seen]] = defaultdict(list)
    carriers: defaultdict[str, list[Seen]] = defaultdict(list)
    cookies: dict[Seen, str | None] = {}
    for pid, (ppid, start) in stats.items():
        seen = (pid, start)
        cookie = cookies[seen] = previous.cookies[seen] if seen in previous.cookies else _cookie(pid)
        if ppid in stats:
            children[(ppid, stats[ppid][1])].append(seen)
        if cookie is not None:
            carriers[cookie].append(seen)
    return Snapshot(taken, children, carriers, cookies)


def stat(pid: int) -> tuple[int, int]:
    """(parent pid, start time in clock ticks since boot) from one read of /proc/<pid>/stat. psutil's ppid()
    reads it twice (the second for its pid-reuse check) and costs about four times as much per process."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        content = f.read()
    fields = content[content.rfind(b")") + 2 :].split()  # after the name, which may hold spaces and parentheses
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


def live_process(seen: Seen) -> psutil.Process | None:
    """The process a snapshot saw, if it still runs: its pid may belong to another one by now."""
    pid, start = seen
    try:
        proc = psutil.Process(pid)
        # Read after: a pid holds one process from its birth to its reaping, so the same start then is the same one.
        return proc if stat(pid)[1] == start else None
    except (psutil.Error, OSError):
        return None


def running(proc: psutil.Process) -> bool:
    try:  # a zombie has exited; only its parent's wait() is missing
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def send(proc: psutil.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(psutil.Error):  # psutil refuses a pid that was reused meanwhile
        proc.send_signal(sig)
