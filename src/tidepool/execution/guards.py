"""Host guards: the free-memory and free-disk floors below which this node stops claiming work.

Every interval_s the guards measure free memory (psutil's `available`) and the free space of the
file system holding node.state_dir. A figure below its floor trips that guard: `ok()` turns false
and the pool's workers stop claiming (running tasks go on). When every guard has cleared, the
`on_clear` callback wakes the pool so work resumes at once rather than at the next poll. A floor
of 0 disables its guard. A probe that fails keeps the guard as it was and logs why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import psutil  # type: ignore[import-untyped]
from anyio.abc import TaskStatus

from ..events import EventBus

if TYPE_CHECKING:
    from ..settings import GuardSettings

log = logging.getLogger("tidepool.guards")
MB = 1 << 20


@dataclass(frozen=True, slots=True)
class GuardStats:
    tripped: tuple[str, ...]          # "memory", "disk"
    min_free_memory_mb: int
    min_free_disk_mb: int
    free_memory_mb: int | None        # None until measured, or when the probe failed
    free_disk_mb: int | None


def free_memory_bytes() -> int:
    return int(psutil.virtual_memory().available)


def free_disk_bytes(path: Path) -> int:
    # The state directory may not exist yet (work directories are made on first use): measure the
    # file system it will live on.
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return int(psutil.disk_usage(str(path)).free)


class Guards:
    def __init__(self, events: EventBus, *, state_dir: Path, min_free_memory_mb: int, min_free_disk_mb: int,
                 on_clear: Callable[[], None] = lambda: None, interval_s: float = 1.0,
                 memory_probe: Callable[[], int] = free_memory_bytes,
                 disk_probe: Callable[[Path], int] = free_disk_bytes) -> None:
        self._events = events
        self._state_dir = state_dir
        self.min_free_memory_mb = min_free_memory_mb
        self.min_free_disk_mb = min_free_disk_mb
        self.on_clear = on_clear
        self.interval_s = interval_s
        self._memory_probe = memory_probe
        self._disk_probe = disk_probe
        self._free: dict[str, int | None] = {"memory": None, "disk": None}
        self._tripped: dict[str, None] = {}  # ordered, for stable output

    def ok(self) -> bool:
        """May this node claim work now? (cheap: asked before every claim)"""
        return not self._tripped

    def configure(self, section: GuardSettings) -> None:
        """New floors (SIGHUP); judged at once so a lowered floor resumes work without waiting."""
        self.min_free_memory_mb, self.min_free_disk_mb = section.min_free_memory_mb, section.min_free_disk_mb
        self._judge()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.check()  # before the pool's first claim
        task_status.started()
        while True:
            await anyio.sleep(self.interval_s)
            self.check()

    def check(self) -> None:
        """Measure and judge. psutil reads /proc/meminfo and calls statvfs: fast enough for the loop."""
        self._free["memory"] = self._measure("memory", self._memory_probe)
        self._free["disk"] = self._measure("disk", lambda: self._disk_probe(self._state_dir))
        self._judge()

    def statistics(self) -> GuardStats:
        return GuardStats(tuple(self._tripped), self.min_free_memory_mb, self.min_free_disk_mb,
                          self._free["memory"], self._free["disk"])

    def _measure(self, guard: str, probe: Callable[[], int]) -> int | None:
        try:
            return probe() // MB
        except (OSError, psutil.Error) as exc:
            log.warning("guard %s: cannot measure, keeping its state: %s", guard, exc)
            return self._free[guard]

    def _judge(self) -> None:
        was_ok = self.ok()
        floors = {"memory": self.min_free_memory_mb, "disk": self.min_free_disk_mb}
        for guard, floor in floors.items():
            free = self._free[guard]
            if free is None:
                continue
            low = free < floor
            if low and guard not in self._tripped:
                self._tripped[guard] = None
                log.warning("guard %s tripped: %d MB free, floor %d MB; not claiming work", guard, free, floor)
                self._events.publish("guard.tripped", guard=guard, free_mb=free, min_free_mb=floor)
            elif not low and guard in self._tripped:
                del self._tripped[guard]
                log.info("guard %s cleared: %d MB free, floor %d MB", guard, free, floor)
                self._events.publish("guard.cleared", guard=guard, free_mb=free, min_free_mb=floor)
        if self.ok() and not was_ok:
            self.on_clear()
