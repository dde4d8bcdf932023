"""The gateway's side of the worker registry: who is calling and whether it is served (its identity bound to
the CA of its first certificate, its version not older than gateway.min_worker_version), and the operator's
changes (enable, disable, limits, organizations, tags, revoke) carried to the worker at once.

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
import re
import time
from collections.abc import Callable

from ..errors import Conflict, IssuerConflict, LeaseGone, WorkerRefused
from ..events import EventBus
from ..metrics.gateway import GatewayMetrics
from ..model import CertSeen, RemoteWorker, WorkerChange, WorkerState, rfc3339
from ..store import Enroll, Revoked, Store
from ..store.rules import allowed_slots
from .control import Controls
from .parking import Parking
from .tls import Peer

log = logging.getLogger("tidepool.gateway")
MEET_EVERY_S = 5.0  # far below how long /v1/nodes waits before it calls a remote worker gone
TAGS_FOR_S = 1.0    # a submit's tag check reads the workers' slots at most this often
LEADING_NUMBERS = re.compile(r"\d+(?:\.\d+)*")
TOLD_AT_MOST = 4096  # refusals remembered as logged; past it they are logged once more


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
        self._told: set[tuple[str, str]] = set()  # (identity, what) refusals already logged: one line each

    # calls of remote workers

    async def meet(self, peer: Peer, *, cert: CertSeen, enroll: Enroll, max_concurrent_tasks: int,
                   version: str | None = None, min_version: str = "") -> RemoteWorker:
        """The caller's record, created at its first contact (pending, or enabled under auto enrollment).
        WorkerRefused worker_outdated for a version older than `min_version` (its record is not touched),
        identity_conflict for a certificate of another CA than the one its identity is bound to, or of no CA of
        the file at all (an intermediate's)."""
        now = self._clock()
        if peer.not_after <= now:  # checked at the handshake, but a keep-alive connection outlives it
            self._metrics.refused.inc(("certificate_expired",))
            raise WorkerRefused(peer.identity, "certificate_expired",
                                f"its client certificate expired at {rfc3339(peer.not_after)}")
        if not peer.issuer:
            self._refuse_unbound(peer)
        if min_version:
            self._refuse_outdated(peer.identity, version, min_version)
        known = self._met.get(peer.identity)
        if known is not None and now - known[0] < MEET_EVERY_S and known[1] == peer.fingerprint:
            return known[2]
        changes = self._changes
        try:
            worker = await self._store.meet_worker(peer.identity, cert=cert, address=peer.address, now=now,
                                                   enroll=enroll, max_concurrent_tasks=max_concurrent_tasks)
        except IssuerConflict as exc:
            self._metrics.refused.inc(("identity_conflict",))
            self._tell_once(peer.identity, f"issuer {exc.presented}", logging.WARNING,
                            "worker %s refused: its identity is bound to the CA %s, this certificate (%s) is of the "
                            "CA %s", peer.identity, exc.bound, peer.fingerprint, exc.presented or "unknown")
            raise WorkerRefused(peer.identity, "identity_conflict", exc.explained()) from None
        except Conflict as exc:
            raise WorkerRefused(peer.identity, "identity_conflict", str(exc)) from None
        if worker.first_seen == worker.last_seen == now:
            log.info("worker %s enrolled from %s: %s", worker.id, peer.address, worker.state.value)
            self._events.publish("worker.enrolled", task_id=None, worker_id=worker.id, state=worker.state.value,
                                 address=peer.address, fingerprint=peer.fingerprint)
        if changes == self._changes:
            self._met[peer.identity] = (now, peer.fingerprint, worker)
        return worker

    def _refuse_unbound(self, peer: Peer) -> None:
        """WorkerRefused identity_conflict for a certificate no CA of the file signed itself (an intermediate
        did): Python's ssl tells no verified chain, so the CA that anchors it is unknown, and an identity bound
        to no CA would be anyone's whose CA the gateway trusts."""
        self._metrics.refused.inc(("identity_conflict",))
        self._tell_once(peer.identity, "no issuer", logging.WARNING, "worker %s refused: no CA of "
                        "gateway.client_ca_file signed its certificate (%s) itself, so its identity cannot be bound "
                        "to a CA; add the CA that did (an intermediate) to gateway.client_ca_file", peer.identity,
                        peer.fingerprint)
        raise WorkerRefused(peer.identity, "identity_conflict", "no CA of the gateway's client CA file signed its "
                            "client certificate itself (an intermediate CA did?), so its identity cannot be bound "
                            "to a CA: the gateway's operator adds that CA to the file")

    def _refuse_outdated(self, identity: str, version: str | None, min_version: str) -> None:
        """WorkerRefused worker_outdated unless `version` is min_version or newer, compared as numbers."""
        if version is not None and version_numbers(version) >= version_numbers(min_version):
            return
        self._metrics.refused.inc(("outdated",))
        said = f"version {version}" if version is not None else "no version"
        self._tell_once(identity, f"version {version}", logging.WARNING, "worker %s refused: it reports %s, older "
                        "than gateway.min_worker_version %s", identity, said, min_version)
        raise WorkerRefused(identity, "worker_outdated", f"it reports {said}; this gateway serves workers of "
                                                         f"version {min_version} or newer: upgrade it")

    def _tell_once(self, identity: str, what: str, level: int, message: str, *args: object) -> None:
        """Log a refusal once per identity and cause: a refused worker retries every few seconds."""
        if (identity, what) not in self._told:
            if len(self._told) >= TOLD_AT_MOST:  # a worker could name a new version on every call
                self._told.clear()
            self._told.add((identity, what))
            log.log(level, message, *args)

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
        if before.issuer is not None and worker.issuer is None:
            log.info("worker %s: its identity binds anew to the CA of its next certificate (was %s)", worker.id,
                     before.issuer)
            self._told = {told for told in self._told if told[0] != worker.id}
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
        elif cancelled:
            log.info("worker %s: %d attempts cancelled (work an operator took away from it)", worker.id,
                     len(cancelled))
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
            self._slots = (now, [s for w in workers if w.state is WorkerState.ENABLED
                                 for s in allowed_slots(w, w.slots)])
        return self._slots[1]


def version_numbers(version: str) -> tuple[int, ...]:
    """A version's leading numbers, trailing zeros dropped, as a tuple that compares as versions do: "0.3" and
    "0.3.0" are equal, "0.10.1" is newer than "0.9"; a version with no leading number is () (the oldest)."""
    found = LEADING_NUMBERS.match(version.strip().removeprefix("v"))
    numbers = [int(n) for n in found.group().split(".")] if found else []
    while numbers and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)
