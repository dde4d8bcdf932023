"""Writes how attempts ended, behind the workers.

A worker posts its attempt's outcome and goes straight on to claim its next task, so the claim and
the outcome reach the store together instead of one round trip after the other. Outcomes that queue
while a write is in flight share the next one: one store call for many. Each write is fenced by its
lease, so trying it again while the store is briefly away is safe; what the store answered is
reported (events, logs) only once it is durable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus

from .errors import StoreUnavailable, TidepoolError
from .leases import Held
from .lifecycle import RetryPolicy
from .model import Outcome, State, Task
from .store import Ending, Store

log = logging.getLogger("tidepool.outcomes")
RETRY_DELAYS_S = (0.2, 0.5, 1.0, 2.0)  # then one last try: well inside any lease


@dataclass(eq=False, slots=True)
class Posted:
    """One attempt's outcome, waiting to be written; `now` is when the attempt ended (the fence's time)."""

    task: Task
    held: Held
    outcome: Outcome
    worker_id: str
    now: float
    tries: int = 0


class OutcomeWriter:
    def __init__(self, store: Store, *, policy: Callable[[], RetryPolicy],
                 report: Callable[[Posted, State | TidepoolError], None],
                 retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S) -> None:
        self._store = store
        self._policy = policy
        self._report = report
        self._retry_delays_s = retry_delays_s
        self._queue: list[Posted] = []
        self._in_flight = 0
        self._posted = anyio.Event()
        self._flushed = anyio.Event()
        self._flushed.set()

    def post(self, posted: Posted) -> None:
        self._queue.append(posted)
        if self._flushed.is_set():
            self._flushed = anyio.Event()
        self._posted.set()

    @property
    def pending(self) -> int:
        """Outcomes posted and not yet answered by the store."""
        return len(self._queue) + self._in_flight

    async def flushed(self) -> None:
        """Until every outcome posted so far has been written (or given up on)."""
        while self.pending:
            await self._flushed.wait()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if not self._queue:
                self._posted = anyio.Event()
                await self._posted.wait()
            batch, self._queue = self._queue, []
            self._in_flight = len(batch)
            try:
                again = await self._write(batch)
            finally:
                self._in_flight = 0
            if again:
                self._queue[:0] = again  # before what was posted meanwhile: it waited longest
                await anyio.sleep(self._retry_delays_s[min(p.tries for p in again) - 1])
            if not self.pending:
                self._flushed.set()

    async def _write(self, batch: list[Posted]) -> list[Posted]:
        """Write a batch and report each answer; the outcomes to try again because the store was away."""
        endings = [Ending(p.held.lease, p.outcome, p.now) for p in batch]
        try:
            answers = await self._store.finish_many(endings, policy=self._policy())
        except StoreUnavailable as exc:  # an adapter that failed as a whole: every outcome shares it
            answers = [exc] * len(batch)
        again = []
        for posted, answer in zip(batch, answers, strict=True):
            if isinstance(answer, StoreUnavailable) and posted.tries < len(self._retry_delays_s):
                posted.tries += 1
                again.append(posted)
            else:
                self._report(posted, answer)
        if again:
            first = again[0]
            log.warning("task %s attempt %s: outcome not written yet (%d waiting), retrying in %.1fs: %s",
                        first.task.id, first.held.lease.attempt_id, len(again),
                        self._retry_delays_s[first.tries - 1], answers[batch.index(first)])
        return again
