"""The memory store's worker registry: the remote workers a gateway serves, and their acquires."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ...errors import WorkerNotFound
from ...model import CertSeen, ClaimFilter, RemoteWorker, State, Worker, WorkerChange, WorkerState
from ..port import Acquired, Enroll, Revoked
from ..rules import (
    REMOTE_INSTANCE,
    acquire_filter,
    changed,
    first_record,
    met_again,
    node_taken,
    reported,
    room,
    spared,
    worth_saving,
)
from . import leases
from .database import Database, TaskRow, cancel


def meet_worker(db: Database, identity: str, *, cert: CertSeen, address: str | None, now: float, enroll: Enroll,
                max_concurrent_tasks: int) -> RemoteWorker:
    if identity in db.nodes:
        raise node_taken(identity)
    known = db.workers.get(identity)
    if known is None:
        saved = first_record(identity, cert, address, now, enroll, max_concurrent_tasks)
    else:
        saved = met_again(known, cert, address, now)
    db.workers[identity] = saved
    return _counted(db, saved)


def list_workers(db: Database) -> list[RemoteWorker]:
    return [_counted(db, db.workers[k]) for k in sorted(db.workers)]


def get_worker(db: Database, worker_id: str) -> RemoteWorker:
    return _counted(db, _worker(db, worker_id))


def change_worker(db: Database, worker_id: str, change: WorkerChange, *,
                  now: float) -> tuple[RemoteWorker, list[Revoked]]:
    after = changed(_worker(db, worker_id), change)
    db.workers[worker_id] = after
    keep = spared(after, change)
    cancelled = _cancel_active(db, worker_id, now, lambda row: row.task.organization not in keep) \
        if keep is not None else []
    return _counted(db, after), cancelled


def revoke_worker(db: Database, worker_id: str, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
    worker = _worker(db, worker_id)
    if worker.state is WorkerState.REVOKED:
        return _counted(db, worker), []
    db.workers[worker_id] = dataclasses.replace(worker, state=WorkerState.REVOKED)
    cancelled = _cancel_active(db, worker_id, now, lambda row: True)
    return _counted(db, db.workers[worker_id]), cancelled


def acquire(db: Database, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
            worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
    known = _worker(db, identity)
    worker = reported(known, slots, version, now)
    if worth_saving(known, worker):
        db.workers[identity] = worker
    worker = _counted(db, worker)
    n = room(worker, limit)
    if n == 0:
        return Acquired(worker, [])
    narrowed, globs = acquire_filter(where, worker)
    claimer = Worker(identity, REMOTE_INSTANCE, worker_id)
    rows = leases.claimable(db, narrowed, now=now, type_globs=globs)[:n]
    return Acquired(worker, [leases.lease_row(db, row, claimer, now=now, lease_s=lease_s) for row in rows])


def cancelling_of(db: Database, identity: str) -> list[str]:
    return [row.lease.attempt_id for row in db.tasks.values()
            if row.task.node_id == identity and row.task.state is State.CANCELLING and row.lease is not None]


def attempt_owners(db: Database, attempt_ids: Sequence[str]) -> dict[str, str]:
    wanted = set(attempt_ids)
    return {a.id: a.node_id for row in db.tasks.values() for a in row.attempts if a.id in wanted}


def _worker(db: Database, worker_id: str) -> RemoteWorker:
    try:
        return db.workers[worker_id]
    except KeyError:
        raise WorkerNotFound(worker_id) from None


def _counted(db: Database, worker: RemoteWorker) -> RemoteWorker:
    live = sum(1 for r in db.tasks.values() if r.task.state.active and r.task.node_id == worker.id)
    return dataclasses.replace(worker, live=live)


def _cancel_active(db: Database, worker_id: str, now: float, which: Callable[[TaskRow], bool]) -> list[Revoked]:
    """Move the worker's leased and running attempts that `which` picks to cancelling, as a cancel does."""
    cancelled = []
    for row in db.tasks.values():
        if row.task.node_id != worker_id or row.task.state not in (State.LEASED, State.RUNNING) or not which(row):
            continue
        assert row.lease is not None
        cancel(row, now)
        cancelled.append(Revoked(row.task.id, row.lease.attempt_id, row.task.type))
    return cancelled
