"""The log lines of tasks that completed: one per task up to a budget a second, then one line a second.

A failure, a retry, a timeout or a cancel is always logged at once, by the engine. A completion is
routine: at a few a second each gets its `task <id> attempt <id> -> completed` line, as an operator
greps for; past LINES_PER_S in a second the rest are counted and said in one line when the second is
over. A pool finishing thousands of no-op tasks a second would otherwise spend about as much of its
event loop on writing their lines as on running them, and journald's default rate limit (10,000
lines per 30 s for a service) would drop most of them anyway.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

LINES_PER_S = 100  # completions logged one by one in a second; the rest are counted
WINDOW_S = 1.0


class Completions:
    def __init__(self, logger: logging.Logger, *, lines_per_s: int = LINES_PER_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._lines_per_s = lines_per_s
        self._monotonic = monotonic
        self._window_at = monotonic()
        self._lines = 0    # said one by one in this window
        self._counted = 0  # past the budget in this window, said together once it ends

    def completed(self, task_id: str, attempt_id: str) -> None:
        if self._monotonic() - self._window_at >= WINDOW_S:
            self.flush()
        if self._lines < self._lines_per_s:
            self._lines += 1
            self._log.info("task %s attempt %s -> completed", task_id, attempt_id)
        else:
            self._counted += 1

    def flush(self, *, final: bool = False) -> None:
        """End the window if it is over (the pool calls this every second), or at once when `final` (the
        drain): the count of the completions past the budget, in one line."""
        now = self._monotonic()
        if now - self._window_at < WINDOW_S and not final:
            return
        if self._counted:
            self._log.info("%d more tasks completed in the last %.1fs (past %d a second, completions are "
                           "counted, not logged one by one)", self._counted, now - self._window_at,
                           self._lines_per_s)
        self._window_at, self._lines, self._counted = now, 0, 0
