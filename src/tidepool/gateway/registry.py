"""The gateway's side of the worker registry: who is calling and whether it is served, and the operator's
changes (enable, disable, limits, organizations, revoke) carried to the worker at once.

The registry itself lives in the store (one record per certificate identity). A call's record is read (and its
last_seen saved) at most every MEET_EVERY_S per identity, so last_seen is that precise: a parked worker's
acquires come back every few seconds, and a store write each was most of what an idle fleet cost the gateway.
The acquire reads the record again in its own transaction, so a state, a cap or an organization always applies
to the next lease. A change made through this
node reaches the worker's control stream and its parked acquires at once; one made through another gateway of
the same PostgreSQL store as well, by the store's notice (heard_change): the record is read again at the
worker's next call, so a revoke refuses its writes at once here too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..errors import Conflict, LeaseGone, WorkerRefused
from ..events import EventBus
from ..metrics.gateway import GatewayMetrics
from ..model import CertSeen, RemoteWorker, WorkerChange, WorkerState, rfc3339
from ..store import Enroll, Revoked, Store
from .control import Controls
from .parking import Parking
from .tls import Peer

log = logging.getLogger("tidepool.gateway")
MEET_EVERY_S = 5.0  # far below how long /v1/nodes waits before it calls a remote worker gone
TAGS_FOR_S = 1.0    # a submit's tag check reads the workers' slots at most this often


class WorkerRegistry:
    def __init__(self, store: Store, events: EventBus, controls: Controls, parking: Parking,
                 metrics: GatewayMetrics, *, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._events = events
        self._controls = controls
        self._parking = parking
        self._metrics = metrics
        self._clock = clock
        self._met: dict[str, tuple[float, str, RemoteWorker]] = {}  # identity -> (when, fingerprint, record)
        self._slots: tuple[float, list[frozenset[str]]] = (-TAGS_FOR_S, [])
        self._changes = 0  # records changed meanwhile: a read begun before a change is not kept

    # calls of remote workers

    async def meet(self, peer: Peer, *, cert: CertSeen, enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
        """The caller's record, created at its first contact (pending, or enabled under auto enrollment)."""
        now = self._clock()
        if peer.not_after <= now:  # checked at the handshake, but a keep-alive connection outlives it
            self._metrics.refused.inc(("certificate_expired",))
            raise WorkerRefused(peer.identity, "certificate_expired",
                                f"its client certificate expired at {rfc3339(peer.not_after)}")
        known = self._met.get(peer.identity)
        if known is not None and now - known[0] < MEET_EVERY_S and known[1] == peer.fingerprint:
            return known[2]
        changes = self._changes
        try:
            worker = await self._store.meet_worker(peer.identity, cert=cert, address=peer.address, now=now,
                                                   enroll=enroll, max_concurrent_tasks=max_concurrent_tasks)
        except Conflict as exc:
            raise WorkerRefused(peer.identity, "identity_conflict", str(exc)) from None
        if worker.first_seen == worker.last_seen == now:
            log.info("worker %s enrolled from %s: %s", worker.id, peer.address, worker.state.value)
            self._events.publish("worker.enrolled", task_id=None, worker_id=worker.id, state=worker.state.value,
                                 address=peer.address, fingerprint=peer.fingerprint)
        if changes == self._changes:
            self._met[peer.identity] = (now, peer.fingerprint, worker)
        return worker

    @property
    def changes(self) -> int:
        """A mark to give `seen`: taken before a read of a record."""
        return self._changes

    def seen(self, worker: RemoteWorker, *, read_after: int) -> None:
        """A fresher record of a worker (an acquire read it in its transaction), unless a record changed since
        the read began (mark `read_after`): the record cached since (a revoke's) is the newer one."""
        known = self._met.get(worker.id)
        if known is not None and read_after == self._changes:
            self._met[worker.id] = (known[0], known[1], worker)

    def refuse_unless_served(self, worker: RemoteWorker, *, write: bool) -> None:
        """pending: 403 worker_pending; revoked: 403 worker_revoked, or 410 for a write behind its leases."""
        if worker.state is WorkerState.PENDING:
            self._metrics.refused.inc(("pending",))
            raise WorkerRefused(worker.id, "worker_pending", "waiting for an operator to enable it "
                                "(tidepool workers enable ID)")
        if worker.state is WorkerState.REVOKED:
            self._metrics.refused.inc(("revoked",))
            if write:
                raise LeaseGone(f"worker {worker.id} is revoked", "revoked")
            raise WorkerRefused(worker.id, "worker_revoked", "revoked by an operator: its calls are refused for good")

    # the operator's side

    async def list_workers(self) -> list[RemoteWorker]:
        workers = await self._store.list_workers()
        self._count(workers)
        return workers

    async def get(self, worker_id: str) -> RemoteWorker:
        return await self._store.get_worker(worker_id)

    async def change(self, worker_id: str, change: WorkerChange) -> RemoteWorker:
        before = await self._store.get_worker(worker_id)
        worker, cancelled = await self._store.change_worker(worker_id, change, now=self._clock())
        self._changed(before, worker, cancelled)
        return worker

    async def revoke(self, worker_id: str) -> RemoteWorker:
        before = await self._store.get_worker(worker_id)
        worker, cancelled = await self._store.revoke_worker(worker_id, now=self._clock())
        self._changed(before, worker, cancelled)
        return worker

    def heard_change(self, worker_id: str, state: str) -> None:
        """Another gateway changed the worker's record (its cancels came first): read again at its next call,
        its new state told on its control stream here (a revoke closes its connections), its parked acquires
        look again."""
        self._changes += 1
        known = self._met.pop(worker_id, None)
        if known is None or known[2].state.value != state:
            if state == WorkerState.REVOKED.value:
                self._controls.cut_off(worker_id, state)
            else:
                self._controls.worker_state(worker_id, state)
        self._parking.wake_identity(worker_id)

    def _changed(self, before: RemoteWorker, worker: RemoteWorker, cancelled: list[Revoked]) -> None:
        """Tell the worker at once: its state on its control stream (a revoke closes its connections), a cancel
        for each attempt the change stopped, and its parked acquires look again."""
        self._changes += 1
        self._met.pop(worker.id, None)
        for attempt in cancelled:
            self._events.publish("task.cancel_requested", task_id=attempt.task_id, worker_id=worker.id,
                                 type=attempt.type, attempt_id=attempt.attempt_id)
            self._controls.cancel(worker.id, attempt.attempt_id)
        if before.state is not worker.state:
            log.info("worker %s %s -> %s (%d attempts cancelled)", worker.id, before.state.value, worker.state.value,
                     len(cancelled))
            self._events.publish("worker.state", task_id=None, worker_id=worker.id, state=worker.state.value,
                                 was=before.state.value, cancelled=len(cancelled))
            if worker.state is WorkerState.REVOKED:
                self._controls.cut_off(worker.id, worker.state.value)
            else:
                self._controls.worker_state(worker.id, worker.state.value)
        self._parking.wake_identity(worker.id)

    def _count(self, workers: list[RemoteWorker]) -> None:
        counts = {s.value: 0 for s in WorkerState}
        for worker in workers:
            counts[worker.state.value] += 1
        self._metrics.workers_by_state = counts

    async def tag_sets(self) -> list[frozenset[str]]:
        """The slots the enabled workers last reported, for a submit's required_tags check."""
        now = self._clock()
        if now - self._slots[0] >= TAGS_FOR_S:
            workers = await self.list_workers()
            self._slots = (now, [frozenset(s) for w in workers if w.state is WorkerState.ENABLED for s in w.slots])
        return self._slots[1]
