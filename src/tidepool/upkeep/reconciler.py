"""Periodic repair of the queue: expire stale leases, promote due retries, end overdue cancels, fail
unserviceable tasks, prune.

Recovery is built in, never a periodic job left to the user. On start the node first expires every
lease its own previous process left behind (that process died: they will not renew); other nodes'
leases expire by time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskStatus

from ..errors import StoreUnavailable
from ..events import EventBus
from ..lifecycle import RetryPolicy
from ..logs import Outage
from ..model import CANCELLED_ON_REQUEST, State, TaskError, cancel_deadline_error
from ..store import LEASE_EXPIRED, UNWRITTEN_INTERRUPTION, Expired, Store

if TYPE_CHECKING:
    from ..settings import ArtifactSettings, ExecutionSettings, ReconcilerSettings, TypeSettings

log = logging.getLogger("tidepool.reconciler")
# the event's error of an attempt the store ended at its run deadline (the task's own says when it passed)
PAST_DEADLINE = TaskError("timeout", "the run deadline passed (run timeout + execution.stop_timeout_s + one lease)")


@dataclass
class ReconcilerConfig:
    interval_s: float = 5.0
    cancel_deadline_s: float = 60.0
    retention_days: float = 14.0
    unserviceable_after_s: float = 60.0  # execution.prepare_timeout_s: how long the fleet may lack a tag set
    # the task types whose attempts run past their run deadline are retried, as a timeout of theirs is
    retry_on_timeout: frozenset[str] = field(default_factory=frozenset)
    keep_unreferenced_s: float = 3600.0  # [artifacts]: how long a blob no task names waits for one

    @classmethod
    def of(cls, section: ReconcilerSettings, execution: ExecutionSettings,
           types: Mapping[str, TypeSettings] | None = None,
           artifacts: ArtifactSettings | None = None) -> ReconcilerConfig:
        retried = frozenset(name for name, t in (types or {}).items() if t.retry_on_timeout)
        keep_s = cls.keep_unreferenced_s if artifacts is None else artifacts.keep_unreferenced_s
        return cls(section.interval_s, execution.cancel_deadline_s, section.retention_days,
                   unserviceable_after_s=execution.prepare_timeout_s, retry_on_timeout=retried,
                   keep_unreferenced_s=keep_s)


@dataclass(frozen=True)
class PassReport:
    expired: int = 0
    promoted: int = 0
    cancelled: int = 0
    pruned: int = 0
    unserviceable: int = 0
    scans: int = 0  # scans moved on that were left between steps
    blobs: int = 0  # blobs deleted that no task named any more


class Reconciler:
    def __init__(self, store: Store, events: EventBus, *, config: ReconcilerConfig,
                 policy: Callable[[], RetryPolicy], wake: Callable[[int], None],
                 fleet_tags: Callable[[], Awaitable[Sequence[frozenset[str]]]] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._events = events
        self.config = config
        self._policy = policy
        self._wake = wake
        self._fleet_tags = fleet_tags  # the resource tag sets of every live node; None: do not judge tags
        self._clock = clock
        self._unserviceable_since: dict[frozenset[str], float] = {}
        self._outage = Outage(log)  # the store did not answer: said once, not every pass

    def configure(self, section: ReconcilerSettings, execution: ExecutionSettings,
                  types: Mapping[str, TypeSettings] | None = None, artifacts: ArtifactSettings | None = None) -> None:
        """A reload's settings, from the next pass on."""
        self.config = ReconcilerConfig.of(section, execution, types, artifacts)

    async def recover(self, *, node_id: str, instance_id: str,
                      interrupted: frozenset[str] = frozenset()) -> list[Expired]:
        """Expire at once the leases an earlier process of this node held: it died, they will not renew.
        Those in `interrupted` its shutdown stopped, but could not write so: they end interrupted."""
        expired = await self._store.expire_leases(now=self._clock(), policy=self._policy(), node_id=node_id,
                                                  keep_instance=instance_id, interrupted=interrupted)
        self.report_expired(expired, "left by an earlier process of this node", interrupted)
        if missed := interrupted - {e.attempt_id for e in expired}:
            log.warning("%d attempts the last shutdown interrupted were ended meanwhile by other nodes, their "
                        "leases having run out during the outage: each used an attempt", len(missed))
        return expired

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await anyio.sleep(self.config.interval_s)
            try:
                await self.pass_once()
            except StoreUnavailable as exc:
                self._outage.failing("reconciler passes skipped until the store answers: %s", exc)
                continue
            self._outage.over("reconciler: the store answers again")

    async def pass_once(self) -> PassReport:
        now = self._clock()
        expired = await self._store.expire_leases(now=now, policy=self._policy(),
                                                  retry_on_timeout=self.config.retry_on_timeout)
        self.report_expired(expired, "not renewed in time")
        promoted = await self._store.promote_due(now=now)
        if promoted:
            self._wake(promoted)
        cancelled = await self._store.finish_cancels(now=now, deadline_s=self.config.cancel_deadline_s)
        for ended in cancelled:
            log.warning("task %s cancelled: its worker did not stop within %ss", ended.task_id,
                        self.config.cancel_deadline_s)
            self._events.publish("task.finished", task_id=ended.task_id, worker_id=None, state=State.CANCELLED.value,
                                 error=cancel_deadline_error(self.config.cancel_deadline_s).to_json(),
                                 type=ended.type)
        unserviceable = await self._fail_unserviceable(now)
        # After the passes that end tasks in bulk, whose scans move on here, and any scan a crash left between
        # two steps: the store tells its listener of every move made.
        moved = await self._store.advance_scans(now=now)
        for move in moved:
            log.info("scan %s moved on by the reconciler: job %s %s%s%s", move.scan_id, move.index,
                     move.job.value if move.job else "-", f", job {move.started} started" if move.task_id else "",
                     f", scan {move.finished.value}" if move.finished else "")
        pruned = 0
        if self.config.retention_days > 0:  # 0: keep every task for good
            pruned = await self._store.prune(before=now - self.config.retention_days * 86400)
        # after the tasks' pruning, which lets go of the blobs its tasks named
        blobs = await self._store.prune_blobs(before=now - self.config.keep_unreferenced_s, now=now)
        report = PassReport(len(expired), promoted, len(cancelled), pruned, unserviceable,
                            len({m.scan_id for m in moved}), blobs)
        self._events.publish("reconciler.pass", **report.__dict__)  # every pass, idle too: a stalled one shows
        if report != PassReport():
            log.info("reconciler: %d expired, %d promoted, %d cancel deadlines, %d pruned, %d unserviceable, "
                     "%d scans moved on, %d blobs deleted", *report.__dict__.values())
        return report

    async def _fail_unserviceable(self, now: float) -> int:
        """Fail the queued tasks whose tag set no live node's resource has covered for unserviceable_after_s.

        A node that restarts or briefly misses heartbeats must not doom its tasks, hence the wait; and an
        unreadable fleet view is no evidence against a tag set, so that pass judges nothing.
        """
        if self._fleet_tags is None:
            return 0
        queued = await self._store.queued_tag_sets()
        if not queued:
            self._unserviceable_since.clear()
            return 0
        try:
            fleet = await self._fleet_tags()
        except StoreUnavailable as exc:
            log.debug("reconciler: unserviceable tags not judged this pass, no fleet view: %s", exc)
            return 0
        lacking = [tags for tags in queued if not any(tags <= have for have in fleet)]
        self._unserviceable_since = {tags: self._unserviceable_since.get(tags, now) for tags in lacking}
        failed = 0
        for tags, since in self._unserviceable_since.items():
            if now - since < self.config.unserviceable_after_s:
                continue
            message = f"no resource of a live node has tags {sorted(tags)} (for {now - since:.1f}s)"
            for ended in await self._store.fail_unserviceable(tags, now=now, message=message):
                log.warning("task %s -> failed (unserviceable: %s)", ended.task_id, message)
                self._events.publish("task.finished", task_id=ended.task_id, worker_id=None, state=State.FAILED.value,
                                     error={"code": "unserviceable", "message": message}, type=ended.type)
                failed += 1
        return failed

    def report_expired(self, expired: list[Expired], why: str, interrupted: frozenset[str] = frozenset()) -> None:
        """Say how each lease ended: expired, timed out at its run deadline, or (named in `interrupted`) an
        earlier shutdown's interruption written only now, which is no expiry and says so."""
        for e in expired:
            if e.timed_out:
                log.warning("task %s attempt %s ran past its run deadline (its worker did not end it) -> %s",
                            e.task_id, e.attempt_id, e.state.value)
                error = (CANCELLED_ON_REQUEST if e.state is State.CANCELLED else PAST_DEADLINE).to_json()
            elif e.attempt_id in interrupted:
                log.info("task %s attempt %s interrupted by the earlier process's shutdown (written now) -> %s",
                         e.task_id, e.attempt_id, e.state.value)
                error = UNWRITTEN_INTERRUPTION.to_json()  # if terminal: past retry.max_interruptions
            else:
                log.warning("task %s attempt %s lease expired (%s) -> %s", e.task_id, e.attempt_id, why,
                            e.state.value)
                self._events.publish("task.expired", task_id=e.task_id, worker_id=None, attempt_id=e.attempt_id,
                                     state=e.state.value, type=e.type)
                # a cancelled one ends as the cancel asked (its attempt expired all the same); the error is
                # the task's own, as stored (`why` is for the log line)
                error = (CANCELLED_ON_REQUEST if e.state is State.CANCELLED else LEASE_EXPIRED).to_json()
            if e.state in (State.PENDING, State.RETRY_WAIT):
                self._wake(1)
            elif e.state.terminal:
                self._events.publish("task.finished", task_id=e.task_id, worker_id=None, state=e.state.value,
                                     error=error, type=e.type)
