"""Periodic repair of the queue: expire stale leases, promote due retries, end overdue cancels, prune.

Recovery is built in, never left to the user (PITFALLS). On start the node first expires every
lease its own previous process left behind (SPEC rule 5); other nodes' leases expire by time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus

from .errors import StoreUnavailable
from .events import EventBus
from .lifecycle import RetryPolicy
from .model import State
from .store import Expired, Store

log = logging.getLogger("tidepool.reconciler")
PRUNE_EVERY_S = 600.0


@dataclass
class ReconcilerConfig:
    interval_s: float = 5.0
    cancel_deadline_s: float = 60.0
    retention_days: float = 14.0


@dataclass(frozen=True)
class PassReport:
    expired: int = 0
    promoted: int = 0
    cancelled: int = 0
    pruned: int = 0


class Reconciler:
    def __init__(self, store: Store, events: EventBus, *, config: ReconcilerConfig,
                 policy: Callable[[], RetryPolicy], wake: Callable[[int], None],
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._events = events
        self.config = config
        self._policy = policy
        self._wake = wake
        self._clock = clock
        self._last_prune = float("-inf")
        self._failing = False  # the store did not answer the last pass: said once, not every pass

    async def recover(self, *, node_id: str, instance_id: str) -> list[Expired]:
        """Expire at once the leases an earlier process of this node held: it died, they will not renew."""
        expired = await self._store.expire_leases(now=self._clock(), policy=self._policy(), node_id=node_id,
                                                  keep_instance=instance_id)
        self._report_expired(expired, "left by an earlier process of this node")
        return expired

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await anyio.sleep(self.config.interval_s)
            try:
                await self.pass_once()
            except StoreUnavailable as exc:
                if not self._failing:
                    log.warning("reconciler passes skipped until the store answers: %s", exc)
                self._failing = True
                continue
            if self._failing:
                log.info("reconciler: the store answers again")
            self._failing = False

    async def pass_once(self) -> PassReport:
        now = self._clock()
        expired = await self._store.expire_leases(now=now, policy=self._policy())
        self._report_expired(expired, "not renewed in time")
        promoted = await self._store.promote_due(now=now)
        if promoted:
            self._wake(promoted)
        cancelled = await self._store.finish_cancels(now=now, deadline_s=self.config.cancel_deadline_s)
        for task_id in cancelled:
            log.warning("task %s cancelled: its worker did not stop within %ss", task_id,
                        self.config.cancel_deadline_s)
            self._events.publish("task.finished", task_id=task_id, worker_id=None, state=State.CANCELLED.value,
                                 error={"code": "cancel_deadline", "message": "the worker did not stop in time"})
        pruned = 0
        if now - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = now
            pruned = await self._store.prune(before=now - self.config.retention_days * 86400)
        report = PassReport(len(expired), promoted, len(cancelled), pruned)
        if report != PassReport():
            self._events.publish("reconciler.pass", **report.__dict__)
            log.info("reconciler: %d expired, %d promoted, %d cancel deadlines, %d pruned", *report.__dict__.values())
        return report

    def _report_expired(self, expired: list[Expired], why: str) -> None:
        for e in expired:
            log.warning("task %s attempt %s lease expired (%s) -> %s", e.task_id, e.attempt_id, why, e.state.value)
            self._events.publish("task.expired", task_id=e.task_id, worker_id=None, attempt_id=e.attempt_id,
                                 state=e.state.value)
            if e.state in (State.PENDING, State.RETRY_WAIT):
                self._wake(1)
            elif e.state.terminal:
                self._events.publish("task.finished", task_id=e.task_id, worker_id=None, state=e.state.value,
                                     error={"code": "lease_expired", "message": why})
