"""The workers' wake-ups: one sleeping worker woken per unit of new work, the rest kept as permits."""

from __future__ import annotations

import collections

import anyio


class Waker:
    """Wakes sleeping workers one per unit of new work; a wake nobody waits for is kept as a permit, up to
    one per worker: workers whose claims looked at the queue before the work went in come back empty, and
    each must claim again rather than sleep a poll interval."""

    def __init__(self, max_permits: int = 1) -> None:
        self._waiters: collections.deque[anyio.Event] = collections.deque()
        self._permits = 0
        self.max_permits = max_permits

    def wake(self, n: int = 1) -> None:
        self.wake_workers(n)

    def wake_workers(self, n: int = 1) -> None:
        """This pool's workers only, however the node's wake reaches others too: for a task already
        leased here and waiting in the handoff for one of them, which is no new work for anyone else."""
        while n > 0 and self._waiters:
            self._waiters.popleft().set()
            n -= 1
        self._permits = min(self.max_permits, self._permits + n)

    def wake_all(self) -> None:
        """Every sleeping worker (a resize or shutdown for them to notice); no permits: a worker not asleep
        sees the change at its next turn anyway."""
        self.wake(len(self._waiters))

    def wake_max(self) -> None:
        """As many workers as the pool may have: every sleeping one, and a permit for each of the others."""
        self.wake(self.max_permits)

    async def wait(self, timeout_s: float) -> None:
        if self._permits:
            self._permits -= 1
            return
        event = anyio.Event()
        self._waiters.append(event)
        try:
            with anyio.move_on_after(timeout_s):
                await event.wait()
        finally:
            if not event.is_set():
                self._waiters.remove(event)
