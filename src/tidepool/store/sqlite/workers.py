"""The worker registry of the SQLite store: the remote workers' records, the cancels of what they hold, and
their acquires.

The writes run on the writer thread (each op one savepoint of a transaction), the reads on the reader
connection. A worker's task types and organizations are JSON lists. An acquire leases with the claim's
statements (leases.py); most acquires find nothing and are answered by a read (Acquires).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

from ...errors import WorkerNotFound
from ...model import (
    CertSeen,
    Claimed,
    ClaimFilter,
    Lease,
    RemoteWorker,
    State,
    Worker,
    WorkerChange,
    WorkerState,
    new_id,
    new_token,
)
from .. import sql
from ..port import Acquired, Enroll, Revoked
from ..rows import worker_of, worker_values
from ..rules import (
    REMOTE_INSTANCE,
    acquire_filter,
    cancel_step,
    changed,
    first_record,
    met_again,
    node_taken,
    reported,
    room,
    spared,
    worth_saving,
)
from .database import Batch, chunks, marks, task_of
from .leases import claimable, lease

Q = sql.queries(__package__, "workers.sql")
T = TypeVar("T")


class Reads(Protocol):
    """The store's reads: a function run on the reader connection."""

    def __call__(self, fn: Callable[[sqlite3.Connection], T]) -> Awaitable[T]: ...


class Writes(Protocol):
    """The store's writes: an op run on the writer thread."""

    def __call__(self, op: Callable[[sqlite3.Connection, Batch], T]) -> Awaitable[T]: ...


def meet_worker(conn: sqlite3.Connection, batch: Batch, *, identity: str, cert: CertSeen, address: str | None,
                now: float, enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
    if conn.execute(Q["node"], (identity,)).fetchone() is not None:
        raise node_taken(identity)
    try:
        saved = met_again(get_worker(conn, identity), cert, address, now)
    except WorkerNotFound:
        saved = first_record(identity, cert, address, now, enroll, max_concurrent_tasks)
    _save(conn, saved)
    return get_worker(conn, identity)


def list_workers(conn: sqlite3.Connection) -> list[RemoteWorker]:
    live = dict(conn.execute(Q["lives"]).fetchall())
    return [_worker(r, live.get(r[0], 0)) for r in conn.execute(Q["workers"])]


def get_worker(conn: sqlite3.Connection, worker_id: str) -> RemoteWorker:
    """The worker's record, its live attempts counted; WorkerNotFound if unknown."""
    row = conn.execute(Q["worker"], (worker_id,)).fetchone()
    if row is None:
        raise WorkerNotFound(worker_id)
    return _worker(row, conn.execute(Q["live"], (worker_id,)).fetchone()[0])


def change_worker(conn: sqlite3.Connection, batch: Batch, *, worker_id: str, change: WorkerChange,
                  now: float) -> tuple[RemoteWorker, list[Revoked]]:
    before = get_worker(conn, worker_id)
    after = changed(before, change)
    _save(conn, after)
    keep = spared(after, change)
    cancelled = _cancel_held(conn, worker_id, now, keep) if keep is not None else []
    return get_worker(conn, worker_id), cancelled


def revoke_worker(conn: sqlite3.Connection, batch: Batch, *, worker_id: str,
                  now: float) -> tuple[RemoteWorker, list[Revoked]]:
    known = get_worker(conn, worker_id)
    if known.state is WorkerState.REVOKED:
        return known, []
    _save(conn, dataclasses.replace(known, state=WorkerState.REVOKED))
    cancelled = _cancel_held(conn, worker_id, now, None)
    return get_worker(conn, worker_id), cancelled


# acquires


class Acquires:
    """The acquires of one store's remote workers. An empty one (a parked worker's, most of them) is a read: no
    write lock, no durable commit. One right after an acquire of this worker that got all it asked for (a
    drain) goes to the writer at once."""

    def __init__(self, read: Reads, write: Writes) -> None:
        self._read = read
        self._write = write
        self._filled: set[str] = set()  # workers whose last acquire got all it asked for

    async def __call__(self, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                       worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
        if identity not in self._filled:
            idle = await self._read(partial(nothing_to_acquire, identity=identity, where=where, limit=limit,
                                            now=now, slots=slots, version=version))
            if idle is not None:
                return idle
        acquired = await self._write(partial(acquire, identity=identity, where=where, limit=limit, now=now,
                                             lease_s=lease_s, worker_id=worker_id, slots=slots, version=version))
        if acquired.claimed and len(acquired.claimed) >= limit:
            self._filled.add(identity)
        else:
            self._filled.discard(identity)
        return acquired


def nothing_to_acquire(conn: sqlite3.Connection, *, identity: str, where: ClaimFilter, limit: int, now: float,
                       slots: Sequence[Sequence[str]], version: str | None) -> Acquired | None:
    """On the reader: the answer of an acquire that would write nothing (its record need not be saved and no
    row is claimable to it), or None when it must take the writer. Nothing is leased from a read, so the
    state, cap, globs and organizations that lease are still decided in the write's transaction."""
    known = get_worker(conn, identity)
    seen = reported(known, slots, version, now)
    if worth_saving(known, seen):
        return None
    n = room(seen, limit)
    if n:
        narrowed, globs = acquire_filter(where, seen)
        if claimable(conn, narrowed, 1, now, globs):
            return None
    return Acquired(seen, [])


def acquire(conn: sqlite3.Connection, batch: Batch, *, identity: str, where: ClaimFilter, limit: int, now: float,
            lease_s: float, worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
    """Read the worker's record (saving what it reports, when worth it) and lease what its state, cap, globs and
    organizations allow, in this one transaction: SQLite's one writer runs no other acquire meanwhile."""
    known = get_worker(conn, identity)
    seen = reported(known, slots, version, now)
    if worth_saving(known, seen):
        _save(conn, seen)
    n = room(seen, limit)
    if n == 0:
        return Acquired(seen, [])
    narrowed, globs = acquire_filter(where, seen)
    claimer = Worker(identity, REMOTE_INSTANCE, worker_id)
    claimed = [Claimed(task_of(r, leased_by=identity, now=now), Lease(r[0], new_id(now), new_token(), now + lease_s))
               for r in claimable(conn, narrowed, n, now, globs)]
    if claimed:
        lease(conn, [(claimer, c, now) for c in claimed])
        if batch.queued is not None:
            batch.queued -= len(claimed)
    return Acquired(seen, claimed)


def cancelling_of(conn: sqlite3.Connection, identity: str) -> list[str]:
    return [r[0] for r in conn.execute(Q["cancelling_of"], (identity,))]


def attempt_owners(conn: sqlite3.Connection, attempt_ids: Sequence[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for chunk in chunks(attempt_ids):
        found.update(conn.execute(Q["attempt_owners"].format(marks=marks(len(chunk))), chunk).fetchall())
    return found


# rows


def _worker(row: Any, live: int) -> RemoteWorker:
    return worker_of(row, task_types=json.loads(row[3]), organizations=json.loads(row[4]), tags=json.loads(row[12]),
                     live=live)


def _save(conn: sqlite3.Connection, w: RemoteWorker) -> None:
    conn.execute(Q["save_worker"], worker_values(w, lists=lambda names: json.dumps(list(names))))


def _cancel_held(conn: sqlite3.Connection, worker_id: str, now: float,
                 keep: Sequence[str] | None) -> list[Revoked]:
    """The worker's leased and running tasks (of the organizations not in keep, when given) -> cancelling, as
    a cancel moves them."""
    narrow, args = "", [worker_id]
    if keep:
        narrow = f"AND organization NOT IN ({marks(len(keep))})"
        args.extend(keep)
    held = [r for r in conn.execute(Q["held_by"].format(organizations=narrow), args).fetchall()
            if r[3] != State.CANCELLING]
    for task_id, _, _, state in held:
        conn.execute(Q["cancel_held"], (cancel_step(State(state)), now, now, task_id))
    return [Revoked(task_id, attempt_id, type_) for task_id, attempt_id, type_, _ in held]
