"""The memory store: an in-process store, the reference fake that passes the same contract as the durable
adapters.

MemoryStore holds one Database (database.py) and hands each verb to the module of its noun, as the other
adapters do. Nothing in a verb awaits, so each one runs whole between two awaits: one transaction, as the
durable stores' are.
"""

from __future__ import annotations

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
from ..digests import CHUNK, Digest, source_chunks, write_new
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
from . import blobs, leases, scans, schedules, tasks, upkeep, workers
from .database import Database
from .leases import renew as renew_leases  # renew's argument has the port's name, `leases`, as the module has


class MemoryStore:
    def __init__(self) -> None:
        self._db = Database()

    # tasks

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        return tasks.add(self._db, new, now=now, max_queued=max_queued)

    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[tuple[str, bool]]:
        return tasks.add_many(self._db, batch, now=now, max_queued=max_queued)

    async def get(self, task_id: str) -> Task:
        return tasks.get(self._db, task_id)

    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                         cursor: str | None = None, organization: str | None = None) -> Page:
        return tasks.list_tasks(self._db, state=state, type=type, limit=limit, cursor=cursor,
                                organization=organization)

    async def counts(self) -> dict[State, int]:
        return tasks.counts(self._db)

    async def organization_counts(self) -> dict[str, int]:
        return tasks.organization_counts(self._db)

    async def request_cancel(self, task_id: str, *, now: float) -> CancelAnswer:
        return tasks.request_cancel(self._db, task_id, now=now)

    async def retry(self, task_id: str, *, now: float, max_queued: int | None = None) -> Task:
        return tasks.retry(self._db, task_id, now=now, max_queued=max_queued)

    # leases

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        return leases.claim(self._db, worker, where, limit=limit, now=now, lease_s=lease_s)

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        return renew_leases(self._db, leases, now=now, lease_s=lease_s)

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        return leases.set_phase(self._db, values.notes(notes), now=now)

    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float,
                            quota: ResultQuota | None = None) -> ResultBatch:
        return leases.record_result(self._db, lease, values.batch(batch), now=now, quota=quota)

    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        return await finish_alone(self, lease, outcome, now=now, policy=policy)

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        endings = values.endings(endings)  # what any worker writes, made storable alike on every store
        return leases.finish_many(self._db, endings, policy=policy)

    async def place_input(self, lease: Lease, sha256: str, path: Path) -> None:
        await write_new(path, source_chunks(blobs.input_bytes(self._db, lease, sha256)))

    async def record_artifact(self, lease: Lease, name: str, source: Path | bytes, *, content_type: str | None,
                              now: float, quota: ArtifactQuota) -> Artifact:
        data, digest = await _collected(source_chunks(source), quota.max_blob_bytes)
        return blobs.record_artifact(self._db, lease, name, data, digest.sha256, content_type=content_type,
                                     now=now, quota=quota)

    # schedules

    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        return schedules.save_schedule(self._db, schedule, now=now)

    async def list_schedules(self) -> list[Schedule]:
        return schedules.list_schedules(self._db)

    async def delete_schedule(self, name: str, *, config_node: str | None = None) -> None:
        schedules.delete_schedule(self._db, name, config_node=config_node)

    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule:
        return schedules.pause_schedule(self._db, name, paused=paused, now=now)

    async def fire_schedules(self, *, now: float,
                             new_task: Callable[[Schedule, float], NewTask | NewScan] | None = None,
                             defines: Callable[[Schedule], bool] = lambda schedule: True,
                             max_queued: int | None = None) -> list[Fired]:
        return schedules.fire_schedules(self._db, now=now, new_task=new_task, defines=defines, max_queued=max_queued)

    # upkeep

    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None, interrupted: frozenset[str] = frozenset(),
                            retry_on_timeout: frozenset[str] = frozenset()) -> list[Expired]:
        return upkeep.expire_leases(self._db, now=now, policy=policy, node_id=node_id, keep_instance=keep_instance,
                                    interrupted=interrupted, retry_on_timeout=retry_on_timeout)

    async def promote_due(self, *, now: float) -> int:
        return upkeep.promote_due(self._db, now=now)

    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[Ended]:
        return upkeep.finish_cancels(self._db, now=now, deadline_s=deadline_s)

    async def prune(self, *, before: float) -> int:
        return upkeep.prune(self._db, before=before)

    async def queued_tag_sets(self) -> list[frozenset[str]]:
        return upkeep.queued_tag_sets(self._db)

    async def fail_unserviceable(self, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
        return upkeep.fail_unserviceable(self._db, tags, now=now, message=message)

    async def save_node(self, node: Node) -> None:
        upkeep.save_node(self._db, node)

    async def lock_node(self, node_id: str, instance_id: str) -> None:
        upkeep.lock_node(self._db, node_id, instance_id)

    async def list_nodes(self) -> list[Node]:
        return upkeep.list_nodes(self._db)

    # scans

    async def add_scan(self, new: NewScan, *, now: float, max_queued: int | None = None) -> tuple[Scan, bool]:
        return scans.add_scan(self._db, new, now=now, max_queued=max_queued)

    async def get_scan(self, scan_id: str) -> Scan:
        return scans.get_scan(self._db, scan_id)

    async def list_scans(self, *, state: ScanState | None = None, profile: str | None = None, limit: int = 50,
                         cursor: str | None = None) -> ScanPage:
        return scans.list_scans(self._db, state=state, profile=profile, limit=limit, cursor=cursor)

    async def cancel_scan(self, scan_id: str, *, now: float) -> ScanCancel:
        return scans.cancel_scan(self._db, scan_id, now=now)

    async def retry_job(self, scan_id: str, index: int, *, now: float, max_queued: int | None = None) -> Scan:
        return scans.retry_job(self._db, scan_id, index, now=now, max_queued=max_queued)

    async def advance_scans(self, *, now: float) -> list[ScanMove]:
        return scans.advance_scans(self._db, now=now)

    def on_scan_moves(self, listener: ScanListener | None) -> None:
        scans.on_scan_moves(self._db, listener)

    # remote workers

    async def meet_worker(self, identity: str, *, cert: CertSeen, address: str | None, now: float,
                          enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
        return workers.meet_worker(self._db, identity, cert=cert, address=address, now=now, enroll=enroll,
                                   max_concurrent_tasks=max_concurrent_tasks)

    async def list_workers(self) -> list[RemoteWorker]:
        return workers.list_workers(self._db)

    async def get_worker(self, worker_id: str) -> RemoteWorker:
        return workers.get_worker(self._db, worker_id)

    async def change_worker(self, worker_id: str, change: WorkerChange, *,
                            now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return workers.change_worker(self._db, worker_id, change, now=now)

    async def revoke_worker(self, worker_id: str, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return workers.revoke_worker(self._db, worker_id, now=now)

    async def acquire(self, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                      worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
        return workers.acquire(self._db, identity, where, limit=limit, now=now, lease_s=lease_s,
                               worker_id=worker_id, slots=slots, version=version)

    async def cancelling_of(self, identity: str) -> list[str]:
        return workers.cancelling_of(self._db, identity)

    async def attempt_owners(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        return workers.attempt_owners(self._db, attempt_ids)

    # blobs

    async def put_blob(self, chunks: AsyncIterable[bytes], *, now: float, max_bytes: int,
                       expect: str | None = None) -> tuple[Blob, bool]:
        data, digest = await _collected(chunks, max_bytes)
        digest.check(expect)
        return blobs.put_blob(self._db, data, digest.sha256, now=now)

    async def get_blob(self, sha256: str) -> Blob:
        return blobs.get_blob(self._db, sha256)

    async def read_blob(self, sha256: str, *, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        data = blobs.blob_bytes(self._db, sha256)
        stop = len(data) if stop is None else min(stop, len(data))
        for at in range(start, stop, CHUNK):
            yield data[at:min(at + CHUNK, stop)]

    async def list_artifacts(self, task_id: str) -> list[Artifact]:
        return blobs.list_artifacts(self._db, task_id)

    async def note_artifact(self, lease: Lease, name: str, blob: Blob, *, content_type: str | None, now: float,
                            quota: ArtifactQuota, identity: str | None = None) -> Artifact:
        return blobs.note_artifact(self._db, lease, name, blob, content_type=content_type, now=now, quota=quota,
                                   identity=identity)

    async def leased_blob(self, identity: str, sha256: str, *, now: float) -> bool:
        return blobs.leased_blob(self._db, identity, sha256, now=now)

    async def prune_blobs(self, *, before: float, now: float) -> int:
        return blobs.prune_blobs(self._db, before=before, now=now)

    # the store's lifecycle: one process, nothing persists and nothing to hear

    async def open(self, *, migrate: bool = True) -> int:
        return 0  # every open starts empty

    async def close(self) -> None:
        pass

    async def write_failure(self) -> str | None:
        return None

    async def watch(self, wake: Callable[[int], None], *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await anyio.sleep_forever()


async def _collected(chunks: AsyncIterable[bytes], max_bytes: int) -> tuple[bytes, Digest]:
    """The bytes whole (this store holds everything in memory) and their digest, BlobTooLarge past max_bytes."""
    digest, parts = Digest(max_bytes), []
    async for chunk in chunks:
        digest.update(chunk)
        parts.append(chunk)
    return b"".join(parts), digest
