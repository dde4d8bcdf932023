"""The embedded SQLite store: WAL with synchronous=FULL, one writer thread that group-commits.

Blobs' bytes are files beside the database, in `blob_dir` (the daemon passes node.state_dir/blobs; by default
the directory `blobs` next to the database file); their rows are in the database with the rest.

Each verb is a call into the module of its noun (tasks, leases, schedules, upkeep, scans, workers), whose
writes run as ops of the writer thread, many to a transaction, and whose reads run on the reader connection;
each module's statements are in the .sql file of its name. The file, its writer and its reader are database.py's.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus

from ...errors import LeaseLost, StoreUnavailable, TidepoolError
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
from ..blobfiles import BlobFiles
from ..digests import Digest, source_chunks, source_size, write_new
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
from .database import Batch, Database, Writer
from .leases import renew as renew_leases  # renew's own argument is named leases

T = TypeVar("T")


class SqliteStore:
    def __init__(self, path: str | Path, *, blob_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.blob_dir = Path(blob_dir) if blob_dir is not None else self.path.parent / "blobs"
        self._files = BlobFiles(self.blob_dir)
        self._db = Database(self.path)
        self._writer = Writer(self._db)
        self._reader: sqlite3.Connection | None = None
        self._read_limiter = anyio.CapacityLimiter(1)
        self._acquire = workers.Acquires(self._read, self._write)

    # tasks

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        return await self._write(partial(tasks.add, new=new, now=now, max_queued=max_queued))

    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[tuple[str, bool]]:
        return await self._write(partial(tasks.add_many, tasks=batch, now=now, max_queued=max_queued))

    async def get(self, task_id: str) -> Task:
        return await self._read(partial(tasks.get, task_id=task_id))

    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                         cursor: str | None = None, organization: str | None = None) -> Page:
        return await self._read(partial(tasks.list_tasks, state=state, type=type, limit=limit, cursor=cursor,
                                        organization=organization))

    async def counts(self) -> dict[State, int]:
        return await self._read(tasks.counts)

    async def organization_counts(self) -> dict[str, int]:
        return await self._read(tasks.organization_counts)

    async def request_cancel(self, task_id: str, *, now: float) -> CancelAnswer:
        return await self._write(partial(tasks.request_cancel, task_id=task_id, now=now, step_ended=scans.task_ended))

    async def retry(self, task_id: str, *, now: float, max_queued: int | None = None) -> Task:
        return await self._write(partial(tasks.retry, task_id=task_id, now=now, max_queued=max_queued))

    # leases

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        claimed: list[Claimed] = await self._writer.write(leases.ClaimOp(worker, where, limit, now, lease_s))
        return claimed

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        return await self._write(partial(renew_leases, leases=leases, now=now, lease_s=lease_s))

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        return await self._write(partial(leases.set_phase, notes=values.notes(notes), now=now))

    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float,
                            quota: ResultQuota | None = None) -> ResultBatch:
        return await self._write(partial(leases.record_result, lease=lease, result=values.batch(batch), now=now,
                                         quota=quota))

    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        return await finish_alone(self, lease, outcome, now=now, policy=policy)

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        endings = values.endings(endings)  # what any worker writes, made storable alike on every store
        if not endings:
            return []
        try:
            results: list[State | TidepoolError] = await self._writer.write(leases.FinishOp(tuple(endings), policy))
        except StoreUnavailable as exc:  # the transaction failed as a whole (or the store is closed): none written
            return [exc] * len(endings)
        return results

    async def place_input(self, lease: Lease, sha256: str, path: Path) -> None:
        await self._read(partial(blobs.check_input, lease=lease, sha256=sha256))
        await write_new(path, self.read_blob(sha256))

    async def record_artifact(self, lease: Lease, name: str, source: Path | bytes, *, content_type: str | None,
                              now: float, quota: ArtifactQuota) -> Artifact:
        # judged before the bytes are stored, so a refused artifact leaves no blob either
        await self._read(partial(blobs.admit, lease=lease, name=name, sha256=None, size=source_size(source), now=now,
                                 quota=quota))
        blob, _ = await self.put_blob(source_chunks(source), now=now, max_bytes=quota.max_blob_bytes)
        return await self.note_artifact(lease, name, blob, content_type=content_type, now=now, quota=quota)

    # schedules

    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        return await self._write(partial(schedules.save_schedule, schedule=schedule, now=now))

    async def list_schedules(self) -> list[Schedule]:
        return await self._read(schedules.list_schedules)

    async def delete_schedule(self, name: str, *, config_node: str | None = None) -> None:
        await self._write(partial(schedules.delete_schedule, name=name, config_node=config_node))

    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule:
        return await self._write(partial(schedules.pause_schedule, name=name, paused=paused, now=now))

    async def fire_schedules(self, *, now: float,
                             new_task: Callable[[Schedule, float], NewTask | NewScan] | None = None,
                             defines: Callable[[Schedule], bool] = lambda schedule: True,
                             max_queued: int | None = None) -> list[Fired]:
        return await self._write(partial(schedules.fire_schedules, now=now, new_task=new_task, defines=defines,
                                         max_queued=max_queued))

    # upkeep: the reconciler's passes, and the fleet (one host: the daemon's lock file keeps one process per node
    # id, and there is nothing to hear)

    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None, interrupted: frozenset[str] = frozenset(),
                            retry_on_timeout: frozenset[str] = frozenset()) -> list[Expired]:
        return await self._write(partial(upkeep.expire_leases, now=now, policy=policy, node_id=node_id,
                                         keep_instance=keep_instance, interrupted=interrupted,
                                         retry_on_timeout=retry_on_timeout))

    async def promote_due(self, *, now: float) -> int:
        return await self._write(partial(upkeep.promote_due, now=now))

    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[Ended]:
        return await self._write(partial(upkeep.finish_cancels, now=now, deadline_s=deadline_s))

    async def prune(self, *, before: float) -> int:
        return await self._write(partial(upkeep.prune, before=before))

    async def queued_tag_sets(self) -> list[frozenset[str]]:
        return await self._read(upkeep.queued_tag_sets)

    async def fail_unserviceable(self, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
        return await self._write(partial(upkeep.fail_unserviceable, tags=tags, now=now, message=message))

    async def save_node(self, node: Node) -> None:
        await self._write(partial(upkeep.save_node, node=node))

    async def lock_node(self, node_id: str, instance_id: str) -> None:
        await self._read(partial(upkeep.lock_node, node_id=node_id, instance_id=instance_id, path=self.path))

    async def list_nodes(self) -> list[Node]:
        return await self._read(upkeep.list_nodes)

    # scans

    async def add_scan(self, new: NewScan, *, now: float, max_queued: int | None = None) -> tuple[Scan, bool]:
        return await self._write(partial(scans.add_scan, new=new, now=now, max_queued=max_queued))

    async def get_scan(self, scan_id: str) -> Scan:
        return await self._read(partial(scans.get_scan, scan_id=scan_id))

    async def list_scans(self, *, state: ScanState | None = None, profile: str | None = None, limit: int = 50,
                         cursor: str | None = None) -> ScanPage:
        return await self._read(partial(scans.list_scans, state=state, profile=profile, limit=limit,
                                        cursor=cursor))

    async def cancel_scan(self, scan_id: str, *, now: float) -> ScanCancel:
        return await self._write(partial(scans.cancel_scan, scan_id=scan_id, now=now))

    async def retry_job(self, scan_id: str, index: int, *, now: float, max_queued: int | None = None) -> Scan:
        return await self._write(partial(scans.retry_job, scan_id=scan_id, index=index, now=now,
                                         max_queued=max_queued))

    async def advance_scans(self, *, now: float) -> list[ScanMove]:
        stalled = await self._read(scans.stalled)
        if not stalled:
            return []
        return await self._write(partial(scans.advance_scans, scan_ids=stalled, now=now))

    def on_scan_moves(self, listener: ScanListener | None) -> None:
        self._writer.on_moves = listener

    # the worker registry

    async def meet_worker(self, identity: str, *, cert: CertSeen, address: str | None, now: float,
                          enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
        return await self._write(partial(workers.meet_worker, identity=identity, cert=cert, address=address,
                                         now=now, enroll=enroll, max_concurrent_tasks=max_concurrent_tasks))

    async def list_workers(self) -> list[RemoteWorker]:
        return await self._read(workers.list_workers)

    async def get_worker(self, worker_id: str) -> RemoteWorker:
        return await self._read(partial(workers.get_worker, worker_id=worker_id))

    async def change_worker(self, worker_id: str, change: WorkerChange, *,
                            now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return await self._write(partial(workers.change_worker, worker_id=worker_id, change=change, now=now))

    async def revoke_worker(self, worker_id: str, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return await self._write(partial(workers.revoke_worker, worker_id=worker_id, now=now))

    async def acquire(self, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                      worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
        return await self._acquire(identity, where, limit=limit, now=now, lease_s=lease_s, worker_id=worker_id,
                                   slots=slots, version=version)

    async def cancelling_of(self, identity: str) -> list[str]:
        return await self._read(partial(workers.cancelling_of, identity=identity))

    async def attempt_owners(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        if not attempt_ids:
            return {}
        return await self._read(partial(workers.attempt_owners, attempt_ids=list(attempt_ids)))

    # blobs: the file is in place before its row commits, the row gone before its file is

    async def put_blob(self, chunks: AsyncIterable[bytes], *, now: float, max_bytes: int,
                       expect: str | None = None) -> tuple[Blob, bool]:
        async def record(digest: Digest) -> tuple[Blob, bool]:
            return await self._write(partial(blobs.put_blob, sha256=digest.sha256, size=digest.size, now=now))

        return await self._files.put(chunks, max_bytes=max_bytes, expect=expect, record=record)

    async def get_blob(self, sha256: str) -> Blob:
        return await self._read(partial(blobs.get_blob, sha256=sha256))

    async def read_blob(self, sha256: str, *, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        await self.get_blob(sha256)
        async for chunk in self._files.read(sha256, start=start, stop=stop):
            yield chunk

    async def list_artifacts(self, task_id: str) -> list[Artifact]:
        return await self._read(partial(blobs.list_artifacts, task_id=task_id))

    async def note_artifact(self, lease: Lease, name: str, blob: Blob, *, content_type: str | None, now: float,
                            quota: ArtifactQuota, identity: str | None = None) -> Artifact:
        return await self._write(partial(blobs.note_artifact, lease=lease, name=name, blob=blob,
                                         content_type=content_type, now=now, quota=quota, identity=identity))

    async def leased_blob(self, identity: str, sha256: str, *, now: float) -> bool:
        return await self._read(partial(blobs.leased_blob, identity=identity, sha256=sha256, now=now))

    async def prune_blobs(self, *, before: float, now: float) -> int:
        return await self._files.prune(partial(self._write, partial(blobs.prune_blobs, before=before)))

    # the adapter's lifecycle

    async def open(self, *, migrate: bool = True) -> int:
        conn, found = await anyio.to_thread.run_sync(self._db.connect_writer, migrate)
        await self._files.open()
        self._reader = await anyio.to_thread.run_sync(self._db.connect_reader)
        self._writer.start(conn)
        return found

    async def close(self) -> None:
        await self._writer.close()
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    async def write_failure(self) -> str | None:
        return self._db.write_failure()

    async def watch(self, wake: Callable[[int], None], *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await anyio.sleep_forever()

    async def _write(self, op: Callable[[sqlite3.Connection, Batch], T]) -> T:
        result: T = await self._writer.write(op)
        return result

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._reader is None:
            raise StoreUnavailable("the store is not open")
        return await anyio.to_thread.run_sync(self._db.read, self._reader, fn, limiter=self._read_limiter)
