"""The shared PostgreSQL store: the verbs of both ports over one schema that several nodes use at once.

Several nodes share one database, so every guarantee lives in the statements themselves (sql/, one file
per noun): claims take rows with FOR UPDATE SKIP LOCKED, every worker write carries its fence (attempt
id + lease token + live state + unexpired lease) in its WHERE clause, and the reconciler's passes skip
rows another node holds, so no task is claimed, expired, promoted or cancelled twice. Times are the
caller's `now` (epoch seconds), never the server's clock, so every adapter keeps one contract.

Each verb is a short call into the module of its noun (tasks, leases, schedules, upkeep, scans,
workers); database.py is the server and its plumbing: the pool, every call's deadline, each node's
dedicated session (its node lock, and LISTEN for the NOTIFY that every write making tasks claimable
sends), group commit and the migrations.

Blobs' bytes are chunks in the database (every node and gateway serves them), or with `blob_dir` (the
daemon's [artifacts] store = "file") files of this node, their rows in the database either way.

Driver: asyncpg, chosen by bench/pg_driver.py: with the WAL flush taken out of the figures, it did
1.15-1.8x the claims and 1.5-2.7x the single-row round trips of psycopg 3 (async) on this machine.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from functools import partial
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
from ..blobfiles import BlobFiles
from ..digests import source_chunks, source_size, write_new
from ..notices import Notice
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
from ..rows import SCHEMA_VERSION
from ..rules import finish_alone
from . import blobs, leases, scans, schedules, tasks, upkeep, workers
from .database import CALL_TIMEOUT_S, CONNECT_TIMEOUT_S, DRIVER_ERRORS, Database, Session, channel_for

__all__ = ["CALL_TIMEOUT_S", "CONNECT_TIMEOUT_S", "DRIVER_ERRORS", "SCHEMA_VERSION", "PostgresStore", "channel_for"]


class PostgresStore:
    """The store of a fleet. `schema` (else the URL's `?schema=NAME`, else "tidepool") holds its tables,
    so several fleets or test runs can share one database. Each call answers within call_timeout_s (a call
    over many rows, as a batch submit, a millisecond more for each), or raises StoreUnavailable."""

    def __init__(self, url: str, *, schema: str | None = None, max_connections: int = 10,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, call_timeout_s: float = CALL_TIMEOUT_S,
                 blob_dir: str | Path | None = None) -> None:
        self._db = Database(url, schema=schema, max_connections=max_connections,
                            connect_timeout_s=connect_timeout_s, call_timeout_s=call_timeout_s)
        self.url, self.schema, self.channel = self._db.url, self._db.schema, self._db.channel
        self._notices = workers.Notices()
        self._session = Session(self._db, self._notices.heard)
        self._told = scans.Told()  # the listener of the scans' moves, however they were made
        self._cancel = tasks.Cancel(scans.step_ended, self._notices.remote_cancel)
        self._leases = leases.Leases(self._db, self._told)
        self._files = None if blob_dir is None else BlobFiles(Path(blob_dir))

    # tasks

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        return await tasks.add(self._db, new, now=now, max_queued=max_queued)

    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[tuple[str, bool]]:
        return await tasks.add_many(self._db, batch, now=now, max_queued=max_queued)

    async def get(self, task_id: str) -> Task:
        return await tasks.get(self._db, task_id)

    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                         cursor: str | None = None, organization: str | None = None) -> Page:
        return await tasks.list_tasks(self._db, state=state, type=type, limit=limit, cursor=cursor,
                                      organization=organization)

    async def counts(self) -> dict[State, int]:
        return await tasks.counts(self._db)

    async def organization_counts(self) -> dict[str, int]:
        return await tasks.organization_counts(self._db)

    async def request_cancel(self, task_id: str, *, now: float) -> CancelAnswer:
        return await tasks.request_cancel(self._db, task_id, now=now, cancel=self._cancel, told=self._told)

    async def retry(self, task_id: str, *, now: float, max_queued: int | None = None) -> Task:
        return await tasks.retry(self._db, task_id, now=now, max_queued=max_queued)

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
        return await self._leases.record_result(lease, values.batch(batch), now=now, quota=quota)

    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        return await finish_alone(self, lease, outcome, now=now, policy=policy)

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        endings = values.endings(endings)  # what any worker writes, made storable alike on every store
        return await self._leases.finish_many(endings, policy=policy)

    async def place_input(self, lease: Lease, sha256: str, path: Path) -> None:
        await blobs.check_input(self._db, lease, sha256)
        await write_new(path, self.read_blob(sha256))

    async def record_artifact(self, lease: Lease, name: str, source: Path | bytes, *, content_type: str | None,
                              now: float, quota: ArtifactQuota) -> Artifact:
        await blobs.check_artifact(self._db, lease, name, source_size(source), now=now, quota=quota)
        blob, _ = await self.put_blob(source_chunks(source), now=now, max_bytes=quota.max_blob_bytes)
        return await self.note_artifact(lease, name, blob, content_type=content_type, now=now, quota=quota)

    # schedules

    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        return await schedules.save_schedule(self._db, schedule, now=now)

    async def list_schedules(self) -> list[Schedule]:
        return await schedules.list_schedules(self._db)

    async def delete_schedule(self, name: str, *, config_node: str | None = None) -> None:
        await schedules.delete_schedule(self._db, name, config_node=config_node)

    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule:
        return await schedules.pause_schedule(self._db, name, paused=paused, now=now)

    async def fire_schedules(self, *, now: float,
                             new_task: Callable[[Schedule, float], NewTask | NewScan] | None = None,
                             defines: Callable[[Schedule], bool] = lambda schedule: True,
                             max_queued: int | None = None) -> list[Fired]:
        return await schedules.fire_schedules(self._db, now=now, new_task=new_task, defines=defines,
                                              max_queued=max_queued)

    # upkeep

    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None, interrupted: frozenset[str] = frozenset(),
                            retry_on_timeout: frozenset[str] = frozenset()) -> list[Expired]:
        return await upkeep.expire_leases(self._db, now=now, policy=policy, node_id=node_id,
                                          keep_instance=keep_instance, interrupted=interrupted, told=self._told,
                                          retry_on_timeout=retry_on_timeout)

    async def promote_due(self, *, now: float) -> int:
        return await upkeep.promote_due(self._db, now=now)

    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[Ended]:
        return await upkeep.finish_cancels(self._db, now=now, deadline_s=deadline_s)

    async def prune(self, *, before: float) -> int:
        return await upkeep.prune(self._db, before=before)

    async def queued_tag_sets(self) -> list[frozenset[str]]:
        return await upkeep.queued_tag_sets(self._db)

    async def fail_unserviceable(self, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
        return await upkeep.fail_unserviceable(self._db, tags, now=now, message=message)

    async def save_node(self, node: Node) -> None:
        await upkeep.save_node(self._db, node)

    async def lock_node(self, node_id: str, instance_id: str) -> None:
        await upkeep.lock_node(self._session, node_id, instance_id)

    async def list_nodes(self) -> list[Node]:
        return await upkeep.list_nodes(self._db)

    # scans

    async def add_scan(self, new: NewScan, *, now: float, max_queued: int | None = None) -> tuple[Scan, bool]:
        return await scans.add_scan(self._db, new, now=now, max_queued=max_queued)

    async def get_scan(self, scan_id: str) -> Scan:
        return await scans.get_scan(self._db, scan_id)

    async def list_scans(self, *, state: ScanState | None = None, profile: str | None = None, limit: int = 50,
                         cursor: str | None = None) -> ScanPage:
        return await scans.list_scans(self._db, state=state, profile=profile, limit=limit, cursor=cursor)

    async def cancel_scan(self, scan_id: str, *, now: float) -> ScanCancel:
        return await scans.cancel_scan(self._db, scan_id, now=now, cancel=self._cancel, told=self._told)

    async def retry_job(self, scan_id: str, index: int, *, now: float, max_queued: int | None = None) -> Scan:
        return await scans.retry_job(self._db, scan_id, index, now=now, max_queued=max_queued)

    async def advance_scans(self, *, now: float) -> list[ScanMove]:
        return await scans.advance_scans(self._db, now=now, told=self._told)

    def on_scan_moves(self, listener: ScanListener | None) -> None:
        self._told.listener = listener

    # remote workers

    async def meet_worker(self, identity: str, *, cert: CertSeen, address: str | None, now: float,
                          enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
        return await workers.meet_worker(self._db, identity, cert=cert, address=address, now=now, enroll=enroll,
                                         max_concurrent_tasks=max_concurrent_tasks)

    async def list_workers(self) -> list[RemoteWorker]:
        return await workers.list_workers(self._db)

    async def get_worker(self, worker_id: str) -> RemoteWorker:
        return await workers.get_worker(self._db, worker_id)

    async def change_worker(self, worker_id: str, change: WorkerChange, *,
                            now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return await workers.change_worker(self._db, worker_id, change, now=now, notices=self._notices)

    async def revoke_worker(self, worker_id: str, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return await workers.revoke_worker(self._db, worker_id, now=now, notices=self._notices)

    async def acquire(self, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                      worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
        return await workers.acquire(self._db, identity, where, limit=limit, now=now, lease_s=lease_s,
                                     worker_id=worker_id, slots=slots, version=version)

    async def cancelling_of(self, identity: str) -> list[str]:
        return await workers.cancelling_of(self._db, identity)

    async def attempt_owners(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        return await workers.attempt_owners(self._db, attempt_ids)

    # blobs: in files, the file is in place before its row commits and the row gone before its file is

    async def put_blob(self, chunks: AsyncIterable[bytes], *, now: float, max_bytes: int,
                       expect: str | None = None) -> tuple[Blob, bool]:
        if self._files is None:
            return await blobs.put_chunks(self._db, chunks, now=now, max_bytes=max_bytes, expect=expect)
        return await self._files.put(chunks, max_bytes=max_bytes, expect=expect,
                                     record=partial(blobs.put_row, self._db, now=now))

    async def get_blob(self, sha256: str) -> Blob:
        return await blobs.get_blob(self._db, sha256)

    async def read_blob(self, sha256: str, *, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        blob = await self.get_blob(sha256)
        read = blobs.read_chunks(self._db, blob, start=start, stop=stop) if self._files is None else \
            self._files.read(sha256, start=start, stop=stop)
        async for chunk in read:
            yield chunk

    async def list_artifacts(self, task_id: str) -> list[Artifact]:
        return await blobs.list_artifacts(self._db, task_id)

    async def note_artifact(self, lease: Lease, name: str, blob: Blob, *, content_type: str | None, now: float,
                            quota: ArtifactQuota, identity: str | None = None) -> Artifact:
        return await blobs.note_artifact(self._db, lease, name, blob, content_type=content_type, now=now,
                                         quota=quota, identity=identity)

    async def leased_blob(self, identity: str, sha256: str, *, now: float) -> bool:
        return await blobs.leased_blob(self._db, identity, sha256, now=now)

    async def prune_blobs(self, *, before: float, now: float) -> int:
        if self._files is None:
            return len(await blobs.prune_blobs(self._db, before=before))
        return await self._files.prune(partial(blobs.prune_blobs, self._db, before=before))

    # the adapter's lifecycle, and what it hears

    async def open(self, *, migrate: bool = True) -> int:
        found = await self._db.open(migrate=migrate, to=SCHEMA_VERSION, functions=[leases.CLAIM_FUNCTION])
        if self._files is not None:
            await self._files.open()
        return found

    async def close(self) -> None:
        await self._leases.drain()
        await self._session.close()
        await self._db.close()

    async def write_failure(self) -> str | None:
        return await self._db.write_failure()

    async def watch(self, wake: Callable[[int], None], *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self._session.watch(wake, task_status=task_status)

    def hear_notices(self, heard: Callable[[Notice], None]) -> None:
        self._notices.hear(heard)
