"""The embedded SQLite store: WAL with synchronous=FULL, one writer thread that group-commits.

Writes are ops run by the writer thread (writer.py), many to a transaction: the workers' ops in
work.py, the queue's in queue_ops.py. Reads use a second connection (reads.py). The file itself, its
migrations and its health are database.py's; every statement is named in queries.sql.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread
import psutil  # type: ignore[import-untyped]
from anyio.abc import TaskStatus

from ...errors import ConfigError, LeaseLost, StoreUnavailable, TidepoolError
from ...lifecycle import RetryPolicy
from ...model import (
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
from ..port import (
    Acquired,
    CancelAnswer,
    Ended,
    Ending,
    Enroll,
    Expired,
    Node,
    Page,
    PhaseNote,
    Revoked,
    ScanCancel,
    ScanListener,
    ScanMove,
    ScanPage,
)
from ..rules import finish_alone
from . import queue_ops, reads, registry, scan_ops, work
from .database import Database
from .writer import Batch, Writer

T = TypeVar("T")


class SqliteStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db = Database(self.path)
        self._writer = Writer(self._db)
        self._reader: sqlite3.Connection | None = None
        self._read_limiter = anyio.CapacityLimiter(1)
        self._acquire_filled: set[str] = set()  # workers whose last acquire got all it asked for

    # lifecycle of the adapter

    async def open(self, *, migrate: bool = True) -> int:
        conn, found = await anyio.to_thread.run_sync(self._db.connect_writer, migrate)
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

    async def _write(self, op: Callable[[sqlite3.Connection, Batch], T]) -> T:
        result: T = await self._writer.write(op)
        return result

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def run() -> T:
            assert self._reader is not None
            try:
                return fn(self._reader)
            except sqlite3.Error as exc:
                self._db.note_corrupt(exc)
                raise StoreUnavailable(f"sqlite read of {self.path} failed: {exc}") from exc

        if self._reader is None:
            raise StoreUnavailable("the store is not open")
        return await anyio.to_thread.run_sync(run, limiter=self._read_limiter)

    # producers

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        return await self._write(partial(queue_ops.add, new=new, now=now, max_queued=max_queued))

    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[tuple[str, bool]]:
        return await self._write(partial(queue_ops.add_many, tasks=batch, now=now, max_queued=max_queued))

    async def get(self, task_id: str) -> Task:
        return await self._read(partial(reads.get, task_id=task_id))

    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                         cursor: str | None = None, organization: str | None = None) -> Page:
        return await self._read(partial(reads.list_tasks, state=state, type=type, limit=limit, cursor=cursor,
                                        organization=organization))

    async def counts(self) -> dict[State, int]:
        return await self._read(reads.counts)

    async def organization_counts(self) -> dict[str, int]:
        return await self._read(reads.organization_counts)

    async def request_cancel(self, task_id: str, *, now: float) -> CancelAnswer:
        return await self._write(partial(queue_ops.request_cancel, task_id=task_id, now=now))

    async def retry(self, task_id: str, *, now: float, max_queued: int | None = None) -> Task:
        return await self._write(partial(queue_ops.retry, task_id=task_id, now=now, max_queued=max_queued))

    # workers

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        claimed: list[Claimed] = await self._writer.write(work.ClaimOp(worker, where, limit, now, lease_s))
        return claimed

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        return await self._write(partial(work.renew, leases=leases, now=now, lease_s=lease_s))

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        return await self._write(partial(work.set_phase, notes=notes, now=now))

    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float) -> ResultBatch:
        return await self._write(partial(work.record_result, lease=lease, result=batch, now=now))

    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        return await finish_alone(self, lease, outcome, now=now, policy=policy)

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        if not endings:
            return []
        try:
            results: list[State | TidepoolError] = await self._writer.write(work.FinishOp(tuple(endings), policy))
        except StoreUnavailable as exc:  # the transaction failed as a whole (or the store is closed): none written
            return [exc] * len(endings)
        return results

    # schedules

    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        return await self._write(partial(queue_ops.save_schedule, schedule=schedule, now=now))

    async def list_schedules(self) -> list[Schedule]:
        return await self._read(reads.schedules)

    async def delete_schedule(self, name: str, *, config_node: str | None = None) -> None:
        await self._write(partial(queue_ops.delete_schedule, name=name, config_node=config_node))

    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule:
        return await self._write(partial(queue_ops.pause_schedule, name=name, paused=paused, now=now))

    async def fire_schedules(self, *, now: float,
                             new_task: Callable[[Schedule, float], NewTask | NewScan] | None = None,
                             defines: Callable[[Schedule], bool] = lambda schedule: True,
                             max_queued: int | None = None) -> list[Fired]:
        return await self._write(partial(queue_ops.fire_schedules, now=now, new_task=new_task,
                                                       defines=defines, max_queued=max_queued))

    # the reconciler

    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None, interrupted: frozenset[str] = frozenset(),
                            ) -> list[Expired]:
        return await self._write(partial(
            queue_ops.expire_leases, now=now, policy=policy, node_id=node_id, keep_instance=keep_instance,
            interrupted=interrupted))

    async def promote_due(self, *, now: float) -> int:
        return await self._write(partial(queue_ops.promote_due, now=now))

    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[Ended]:
        return await self._write(partial(queue_ops.finish_cancels, now=now, deadline_s=deadline_s))

    async def prune(self, *, before: float) -> int:
        return await self._write(partial(queue_ops.prune, before=before))

    async def queued_tag_sets(self) -> list[frozenset[str]]:
        return await self._read(reads.queued_tag_sets)

    async def fail_unserviceable(self, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
        return await self._write(partial(queue_ops.fail_unserviceable, tags=tags, now=now,
                                                      message=message))

    # scans (scan_ops.py; their moves inside a task's end: scan_steps.py)

    async def add_scan(self, new: NewScan, *, now: float, max_queued: int | None = None) -> tuple[Scan, bool]:
        return await self._write(partial(scan_ops.add_scan, new=new, now=now, max_queued=max_queued))

    async def get_scan(self, scan_id: str) -> Scan:
        return await self._read(partial(scan_ops.read, scan_id=scan_id))

    async def list_scans(self, *, state: ScanState | None = None, profile: str | None = None, limit: int = 50,
                         cursor: str | None = None) -> ScanPage:
        return await self._read(partial(scan_ops.list_scans, state=state, profile=profile, limit=limit,
                                        cursor=cursor))

    async def cancel_scan(self, scan_id: str, *, now: float) -> ScanCancel:
        return await self._write(partial(scan_ops.cancel_scan, scan_id=scan_id, now=now))

    async def retry_job(self, scan_id: str, index: int, *, now: float, max_queued: int | None = None) -> Scan:
        return await self._write(partial(scan_ops.retry_job, scan_id=scan_id, index=index, now=now,
                                         max_queued=max_queued))

    async def advance_scans(self, *, now: float) -> list[ScanMove]:
        stalled = await self._read(scan_ops.stalled)
        if not stalled:
            return []
        return await self._write(partial(scan_ops.advance_scans, scan_ids=stalled, now=now))

    def on_scan_moves(self, listener: ScanListener | None) -> None:
        self._writer.on_moves = listener

    # the fleet: one host, so the daemon's lock file keeps one process per node id, and nothing to hear

    async def lock_node(self, node_id: str, instance_id: str) -> None:
        """The daemon's lock file keeps one process per node id; a lock file deleted while its daemon ran
        would not, so the node's own row is asked as well: a live process of this node on this host."""
        holder = await self._read(partial(reads.node_row, node_id=node_id))
        if holder is not None and holder.instance_id != instance_id and _alive_here(holder):
            raise ConfigError(f"node {node_id} already runs on {self.path}: pid {holder.pid} (instance "
                              f"{holder.instance_id}, heard from {time.time() - holder.heartbeat_at:.0f}s ago); "
                              "stop it or give this daemon another node.id")

    async def save_node(self, node: Node) -> None:
        await self._write(partial(queue_ops.save_node, values=queue_ops.node_values_of(node)))

    async def list_nodes(self) -> list[Node]:
        return await self._read(reads.nodes)

    async def watch(self, wake: Callable[[int], None], *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await anyio.sleep_forever()

    # the worker registry (registry.py)

    async def meet_worker(self, identity: str, *, cert: CertSeen, address: str | None, now: float,
                          enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
        return await self._write(partial(registry.meet, identity=identity, cert=cert, address=address, now=now,
                                         enroll=enroll, max_concurrent_tasks=max_concurrent_tasks))

    async def list_workers(self) -> list[RemoteWorker]:
        return await self._read(registry.list_workers)

    async def get_worker(self, worker_id: str) -> RemoteWorker:
        return await self._read(partial(registry.read_worker, worker_id=worker_id))

    async def change_worker(self, worker_id: str, change: WorkerChange, *,
                            now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return await self._write(partial(registry.change, worker_id=worker_id, change=change, now=now))

    async def revoke_worker(self, worker_id: str, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return await self._write(partial(registry.revoke, worker_id=worker_id, now=now))

    async def acquire(self, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                      worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
        # An empty acquire (a parked worker's, most of them) is a read: no write lock, no durable commit. One
        # right after an acquire of this worker that got all it asked for (a drain) goes to the writer at once.
        if identity not in self._acquire_filled:
            idle = await self._read(partial(registry.nothing_to_acquire, identity=identity, where=where,
                                            limit=limit, now=now, slots=slots, version=version))
            if idle is not None:
                return idle
        acquired: Acquired = await self._write(partial(
            registry.acquire, identity=identity, where=where, limit=limit, now=now, lease_s=lease_s,
            worker_id=worker_id, slots=slots, version=version))
        if acquired.claimed and len(acquired.claimed) >= limit:
            self._acquire_filled.add(identity)
        else:
            self._acquire_filled.discard(identity)
        return acquired

    async def attempt_owners(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        if not attempt_ids:
            return {}
        return await self._read(partial(registry.attempt_owners, attempt_ids=list(attempt_ids)))


def _alive_here(node: Node) -> bool:
    """Whether the process a node row names still runs on this host, and is that process (a pid reused
    since was born after the node started)."""
    if node.stopped_at is not None or node.hostname != socket.gethostname() or node.pid == os.getpid():
        return False
    try:
        process = psutil.Process(node.pid)
        born: float = process.create_time()
        return born <= node.started_at + 1.0 and process.status() != psutil.STATUS_ZOMBIE  # killed, not reaped
    except psutil.Error:
        return False
