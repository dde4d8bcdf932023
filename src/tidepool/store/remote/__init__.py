"""The store of a remote worker (store.url = "https://…"): its gateway, reached over HTTPS with a client
certificate. Only the worker's verbs reach it, over the /w1 routes; the queue's are the gateway's and
refuse here.

RemoteStore is each port verb in turn, as a call into the module of its noun: the HTTPS session with
the gateway (database.py), the worker verbs and which leases are still live here (leases.py), the
worker's standing and the control stream that carries it (workers.py), and the queue's verbs that
refuse (tasks.py, schedules.py, upkeep.py, scans.py); the inputs it fetches into its cache and the artifacts
it uploads (blobs.py, whose queue verbs refuse too).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from ...errors import LeaseLost, TidepoolError
from ...lifecycle import RetryPolicy
from ...model import (
    Artifact,
    Blob,
    CertSeen,
    Claimed,
    ClaimFilter,
    Lease,
    NewTask,
    Outcome,
    RemoteWorker,
    ResultBatch,
    State,
    Task,
    Worker,
    WorkerChange,
)
from ...scans import NewScan, Scan, ScanState
from ...schedules import Fired, Schedule
from .. import values
from ..port import (
    Acquired,
    ArtifactQuota,
    CancelAnswer,
    Ended,
    Ending,
    Enroll,
    Expired,
    Node,
    Page,
    PhaseNote,
    ResultQuota,
    Revoked,
    ScanCancel,
    ScanListener,
    ScanMove,
    ScanPage,
)
from ..rules import finish_alone
from . import blobs, scans, schedules, tasks, upkeep, workers
from .blobs import GatewayBlobs
from .database import Calls, Refusal, Wire, client_tls
from .leases import GatewayLeases, HeldAttempt, LeaseTerms
from .workers import ControlStream, Standing

__all__ = ["HeldAttempt", "LeaseTerms", "Refusal", "RemoteStore"]


class RemoteStore:
    def __init__(self, url: str, *, cert_file: str, key_file: str, ca_file: str,
                 monotonic: Callable[[], float] = time.monotonic, clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self._wire = Wire(url, client_tls(cert_file=cert_file, key_file=key_file, ca_file=ca_file))
        self._calls = Calls(self._wire, monotonic)
        self._wake_max: Callable[[], None] = lambda: None
        self.standing = Standing(on_enabled=lambda: self._wake_max(), on_revoked=lambda: self._leases.revoked())
        self._leases = GatewayLeases(url, self._calls, self.standing, monotonic=monotonic, clock=clock)
        self._blobs = GatewayBlobs(self._wire, self._calls, self._leases)
        self._control = ControlStream(self._wire, self.standing, cancel=self._leases.cancel,
                                      wake_max=lambda: self._wake_max())

    # wiring

    def attach(self, *, held: Callable[[], Sequence[HeldAttempt]], on_terms: Callable[[LeaseTerms], None],
               wake_max: Callable[[], None], on_revoked: Callable[[], None]) -> None:
        """The node's parts: the lease keeper's attempts, for the gateway's cancels and revoke; on_terms(terms)
        to renew at the gateway's pace; wake_max() to wake every idle worker (enabled again, a control stream
        back: wake-ups may have been missed); on_revoked() once every attempt was told to stop."""
        self._leases.attach(held=held, on_terms=on_terms, on_revoked=on_revoked)
        self._wake_max = wake_max

    def use_certificates(self, *, cert_file: str, key_file: str, ca_file: str) -> None:
        """A reload: the files read again (a rotated certificate, a new CA bundle), for the connections made
        from now on; ConfigError naming the key, and nothing changed, when one cannot be loaded."""
        self._wire.tls = client_tls(cert_file=cert_file, key_file=key_file, ca_file=ca_file)

    def keep_inputs(self, root: Path, *, cache_mb: int) -> None:
        """Keep fetched inputs under `root` ([artifacts] cache_mb of them); else none is kept beyond its place."""
        self._blobs.cache.use(root, max_bytes=cache_mb << 20)

    def stop_acquiring(self) -> None:
        """A drain: claim nothing more; a parked acquire comes back with what the gateway leased meanwhile."""
        self._leases.stop_acquiring()

    # leases

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        return await self._leases.claim(worker, where, limit=limit, now=now, lease_s=lease_s)

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        return await self._leases.renew(leases, now=now, lease_s=lease_s)

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        return await self._leases.set_phase(values.notes(notes), now=now)

    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float,
                            quota: ResultQuota | None = None) -> ResultBatch:
        # the gateway holds it to its own quota
        return await self._leases.record_result(lease, values.batch(batch), now=now)

    async def place_input(self, lease: Lease, sha256: str, path: Path) -> None:
        await self._blobs.place_input(lease, sha256, path)

    async def record_artifact(self, lease: Lease, name: str, source: Path | bytes, *, content_type: str | None,
                              now: float, quota: ArtifactQuota) -> Artifact:
        return await self._blobs.record_artifact(lease, name, source, content_type=content_type, quota=quota)

    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        return await finish_alone(self, lease, outcome, now=now, policy=policy)

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        endings = values.endings(endings)  # what any worker writes, made storable alike on every store
        return await self._leases.finish_many(endings, policy=policy)

    # tasks

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        return await tasks.add(self.url)

    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[tuple[str, bool]]:
        return await tasks.add_many(self.url)

    async def get(self, task_id: str) -> Task:
        return await tasks.get(self.url)

    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                         cursor: str | None = None, organization: str | None = None) -> Page:
        return await tasks.list_tasks(self.url)

    async def counts(self) -> dict[State, int]:
        return await tasks.counts()

    async def organization_counts(self) -> dict[str, int]:
        return await tasks.organization_counts()

    async def request_cancel(self, task_id: str, *, now: float) -> CancelAnswer:
        return await tasks.request_cancel(self.url)

    async def retry(self, task_id: str, *, now: float, max_queued: int | None = None) -> Task:
        return await tasks.retry(self.url)

    # schedules

    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        return await schedules.save_schedule(self.url)

    async def list_schedules(self) -> list[Schedule]:
        return await schedules.list_schedules(self.url)

    async def delete_schedule(self, name: str, *, config_node: str | None = None) -> None:
        await schedules.delete_schedule(self.url)

    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule:
        return await schedules.pause_schedule(self.url)

    async def fire_schedules(self, *, now: float,
                             new_task: Callable[[Schedule, float], NewTask | NewScan] | None = None,
                             defines: Callable[[Schedule], bool] = lambda schedule: True,
                             max_queued: int | None = None) -> list[Fired]:
        return await schedules.fire_schedules(self.url)

    # upkeep

    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None, interrupted: frozenset[str] = frozenset(),
                            retry_on_timeout: frozenset[str] = frozenset()) -> list[Expired]:
        return await upkeep.expire_leases(self.url)

    async def promote_due(self, *, now: float) -> int:
        return await upkeep.promote_due(self.url)

    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[Ended]:
        return await upkeep.finish_cancels(self.url)

    async def prune(self, *, before: float) -> int:
        return await upkeep.prune(self.url)

    async def queued_tag_sets(self) -> list[frozenset[str]]:
        return await upkeep.queued_tag_sets(self.url)

    async def fail_unserviceable(self, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
        return await upkeep.fail_unserviceable(self.url)

    async def save_node(self, node: Node) -> None:
        await upkeep.save_node()

    async def lock_node(self, node_id: str, instance_id: str) -> None:
        await upkeep.lock_node()

    async def list_nodes(self) -> list[Node]:
        return await upkeep.list_nodes(self.url)

    # scans

    async def add_scan(self, new: NewScan, *, now: float, max_queued: int | None = None) -> tuple[Scan, bool]:
        return await scans.add_scan(self.url)

    async def get_scan(self, scan_id: str) -> Scan:
        return await scans.get_scan(self.url)

    async def list_scans(self, *, state: ScanState | None = None, profile: str | None = None, limit: int = 50,
                         cursor: str | None = None) -> ScanPage:
        return await scans.list_scans(self.url)

    async def cancel_scan(self, scan_id: str, *, now: float) -> ScanCancel:
        return await scans.cancel_scan(self.url)

    async def retry_job(self, scan_id: str, index: int, *, now: float, max_queued: int | None = None) -> Scan:
        return await scans.retry_job(self.url)

    async def advance_scans(self, *, now: float) -> list[ScanMove]:
        return await scans.advance_scans()

    def on_scan_moves(self, listener: ScanListener | None) -> None:
        scans.on_scan_moves()

    # workers

    async def meet_worker(self, identity: str, *, cert: CertSeen, address: str | None, now: float,
                          enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
        return await workers.meet_worker(self.url)

    async def list_workers(self) -> list[RemoteWorker]:
        return await workers.list_workers(self.url)

    async def get_worker(self, worker_id: str) -> RemoteWorker:
        return await workers.get_worker(self.url)

    async def change_worker(self, worker_id: str, change: WorkerChange, *,
                            now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return await workers.change_worker(self.url)

    async def revoke_worker(self, worker_id: str, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return await workers.revoke_worker(self.url)

    async def acquire(self, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                      worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
        return await workers.acquire(self.url)

    async def cancelling_of(self, identity: str) -> list[str]:
        return await workers.cancelling_of(self.url)

    async def attempt_owners(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        return await workers.attempt_owners(self.url)

    # blobs

    async def put_blob(self, chunks: AsyncIterable[bytes], *, now: float, max_bytes: int,
                       expect: str | None = None) -> tuple[Blob, bool]:
        return await blobs.put_blob(self.url)

    async def get_blob(self, sha256: str) -> Blob:
        return await blobs.get_blob(self.url)

    def read_blob(self, sha256: str, *, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        return blobs.read_blob(self.url)

    async def list_artifacts(self, task_id: str) -> list[Artifact]:
        return await blobs.list_artifacts(self.url)

    async def note_artifact(self, lease: Lease, name: str, blob: Blob, *, content_type: str | None, now: float,
                            quota: ArtifactQuota, identity: str | None = None) -> Artifact:
        return await blobs.note_artifact(self.url)

    async def leased_blob(self, identity: str, sha256: str, *, now: float) -> bool:
        return await blobs.leased_blob(self.url)

    async def prune_blobs(self, *, before: float, now: float) -> int:
        return await blobs.prune_blobs(self.url)

    # wake-ups

    async def watch(self, wake: Callable[[int], None], *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Follow the gateway's control stream: its cancels, this worker's state, and wake-ups for the pool."""
        self._leases.wake = wake
        await self._control.run(wake, task_status=task_status)

    # the store

    async def open(self, *, migrate: bool = True) -> int:
        """Nothing is sent: a gateway away at start is reached when it comes back. A worker has no schema."""
        self._wire.open()
        return 0

    async def close(self) -> None:
        await self._wire.close()

    async def write_failure(self) -> str | None:
        if self.standing.state in ("revoked", "pending"):
            return f"the gateway {self.url} has this worker {self.standing.state}"
        return self._calls.gone
