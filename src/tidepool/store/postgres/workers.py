"""The remote workers: the worker registry, which several gateways may share, and the notices those gateways
send each other through the store.

Each write of a record runs in one transaction that locks the worker's row first: two acquires of one worker
through two gateways take turns, so the second counts the first's leases against the cap; the claim
function's SKIP LOCKED keeps any task from being leased twice.

Notices go on the schema's NOTIFY channel beside the wake-ups, inside the transaction of the change they
tell of, and are heard on each node's LISTEN connection. A payload is `ORIGIN cancel ATTEMPT WORKER` or
`ORIGIN worker STATE WORKER`: the worker's identity comes last, as it may hold spaces. ORIGIN names the
process that sent it, which acts on its own changes in memory and skips its notices. A wake-up's payload
is a number, so the two never mix, and a node of an older version takes a notice for one wake-up.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import WorkerNotFound
from ...lifecycle import Event, step
from ...model import (
    CertSeen,
    Claimed,
    ClaimFilter,
    Lease,
    RemoteWorker,
    State,
    WorkerChange,
    WorkerState,
    new_id,
    new_token,
)
from .. import sql
from ..notices import Notice, NoticeKind
from ..port import Acquired, Enroll, Revoked
from ..rows import task_of, worker_of, worker_values
from ..rules import (
    REMOTE_INSTANCE,
    acquire_filter,
    changed,
    first_record,
    met_again,
    node_taken,
    postgres_regex,
    reported,
    room,
    spared,
    worth_saving,
)
from . import leases
from .database import Conn, Database

SQL = sql.queries(__package__, "workers.sql")
CANCELLING = step(State.RUNNING, Event.CANCEL).value  # where a cancel moves a leased or running task


class Notices:
    """The notices of one process: sent inside the caller's transaction, heard from its node's session."""

    def __init__(self) -> None:
        self.origin = new_token()[:16]
        self._heard: Callable[[Notice], None] | None = None

    def hear(self, heard: Callable[[Notice], None]) -> None:
        self._heard = heard

    async def remote_cancel(self, conn: Conn, task_id: str) -> None:
        """A cancel of `task_id`: told only if a remote worker holds it."""
        await conn.execute(SQL["notify_remote_cancel"], task_id, self.origin, REMOTE_INSTANCE)

    async def worker_changed(self, conn: Conn, worker: RemoteWorker, cancelled: Sequence[Revoked]) -> None:
        """The cancels a change made first, then the record's change: a revoke's last frame ends the stream."""
        payloads = [f"{self.origin} cancel {r.attempt_id} {worker.id}" for r in cancelled]
        payloads.append(f"{self.origin} worker {worker.state.value} {worker.id}")
        await conn.execute(SQL["notify_all"], payloads)

    def heard(self, payload: str) -> bool:
        """Whether `payload` was a notice (acted on unless this process sent it); False: a wake-up's."""
        parts = payload.split(" ", 3)
        if len(parts) != 4 or parts[1] not in ("cancel", "worker"):
            return False
        origin, kind, detail, worker_id = parts
        if origin == self.origin or self._heard is None:
            return True
        if kind == "cancel":
            notice = Notice(NoticeKind.CANCEL, worker_id, attempt_id=detail)
        else:
            notice = Notice(NoticeKind.WORKER, worker_id, state=detail)
        self._heard(notice)
        return True


# the registry


async def meet_worker(db: Database, identity: str, *, cert: CertSeen, address: str | None, now: float,
                      enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
    async with db.conn() as conn, conn.transaction():
        if await conn.fetchval(SQL["is_node"], identity) is not None:
            raise node_taken(identity)
        first = first_record(identity, cert, address, now, enroll, max_concurrent_tasks)
        if await conn.fetchval(SQL["first_contact"], *_values(first)) is None:
            await conn.execute(SQL["save_worker"], *_values(met_again(await _locked(conn, identity), cert,
                                                                      address, now)))
        return await _read(conn, identity)


async def list_workers(db: Database) -> list[RemoteWorker]:
    async with db.conn() as conn:
        return [_worker(r) for r in await conn.fetch(SQL["workers"])]


async def get_worker(db: Database, worker_id: str) -> RemoteWorker:
    async with db.conn() as conn:
        return await _read(conn, worker_id)


async def change_worker(db: Database, worker_id: str, change: WorkerChange, *, now: float,
                        notices: Notices) -> tuple[RemoteWorker, list[Revoked]]:
    async with db.conn() as conn, conn.transaction():
        before = await _locked(conn, worker_id)
        after = changed(before, change)
        await conn.execute(SQL["save_worker"], *_values(after))
        keep = spared(after, change)
        cancelled = await _cancel_held(conn, worker_id, now, keep) if keep is not None else []
        await notices.worker_changed(conn, after, cancelled)
        return await _read(conn, worker_id), cancelled


async def revoke_worker(db: Database, worker_id: str, *, now: float,
                        notices: Notices) -> tuple[RemoteWorker, list[Revoked]]:
    async with db.conn() as conn, conn.transaction():
        known = await _locked(conn, worker_id)
        if known.state is WorkerState.REVOKED:
            return known, []
        revoked = dataclasses.replace(known, state=WorkerState.REVOKED)
        await conn.execute(SQL["save_worker"], *_values(revoked))
        cancelled = await _cancel_held(conn, worker_id, now, None)
        await notices.worker_changed(conn, revoked, cancelled)
        return await _read(conn, worker_id), cancelled


async def acquire(db: Database, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                  worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
    idle = await _nothing_to_acquire(db, identity, where, limit, now, slots, version)
    if idle is not None:
        return idle
    async with db.conn(rows=max(limit, 0)) as conn, conn.transaction():
        known = await _locked(conn, identity)
        seen = reported(known, slots, version, now)
        if worth_saving(known, seen):
            await conn.execute(SQL["save_worker"], *_values(seen))
        n = room(seen, limit)
        if n == 0:
            return Acquired(seen, [])
        narrowed, globs = acquire_filter(where, seen)
        claimed = await _claim(conn, identity, worker_id, narrowed, globs, n, now, lease_s)
        return Acquired(seen, claimed)


async def cancelling_of(db: Database, identity: str) -> list[str]:
    async with db.conn() as conn:
        return [r[0] for r in await conn.fetch(SQL["cancelling_of"], identity)]


async def attempt_owners(db: Database, attempt_ids: Sequence[str]) -> dict[str, str]:
    if not attempt_ids:
        return {}
    async with db.conn() as conn:
        return {r[0]: r[1] for r in await conn.fetch(SQL["attempt_owners"], list(attempt_ids))}


async def _nothing_to_acquire(db: Database, identity: str, where: ClaimFilter, limit: int, now: float,
                              slots: Sequence[Sequence[str]], version: str | None) -> Acquired | None:
    """Without a transaction: the answer of an acquire that would write nothing (the record need not be
    saved, no row is claimable to it), or None when it must lock. Nothing is leased from this read, so the
    state, cap, globs and organizations that lease are still decided under the worker's row lock."""
    async with db.conn() as conn:
        known = await _read(conn, identity)
        seen = reported(known, slots, version, now)
        if worth_saving(known, seen):
            return None
        n = room(seen, limit)
        if n:
            arguments = _claim_arguments(*acquire_filter(where, seen))
            if arguments is not None and await conn.fetchval(SQL["claimable_any"], now, *arguments) is not None:
                return None
        return Acquired(seen, [])


def _worker(row: Any) -> RemoteWorker:
    return worker_of(row, task_types=row[3], organizations=row[4], tags=row[12], live=row[13])


def _values(w: RemoteWorker) -> tuple[Any, ...]:
    return worker_values(w, lists=list)


async def _read(conn: Conn, worker_id: str) -> RemoteWorker:
    row = await conn.fetchrow(SQL["worker"], worker_id)
    if row is None:
        raise WorkerNotFound(worker_id)
    return _worker(row)


async def _locked(conn: Conn, worker_id: str) -> RemoteWorker:
    """The worker's record, its row locked until the transaction ends; WorkerNotFound if unknown."""
    if await conn.fetchval(SQL["lock_worker"], worker_id) is None:
        raise WorkerNotFound(worker_id)
    return await _read(conn, worker_id)


async def _cancel_held(conn: Conn, worker_id: str, now: float, keep: Sequence[str] | None) -> list[Revoked]:
    rows = await conn.fetch(SQL["cancel_held"], worker_id, now, CANCELLING,
                            None if keep is None else list(keep))
    return [Revoked(r[0], r[1], r[2]) for r in rows]


async def _claim(conn: Conn, identity: str, worker_id: str, where: ClaimFilter, globs: Sequence[str] | None, n: int,
                 now: float, lease_s: float) -> list[Claimed]:
    """Lease up to n tasks to the identity by the schema's claim function, inside the caller's transaction."""
    arguments = _claim_arguments(where, globs)
    if arguments is None:
        return []
    patterns, tag_sets, organizations = arguments
    pairs = [(new_id(now), new_token()) for _ in range(n)]
    rows = await leases.claim_rows(
        conn, now, n, [a for a, _ in pairs], [t for _, t in pairs], [identity] * n, [REMOTE_INSTANCE] * n,
        [worker_id] * n, [now] * n, [now + lease_s] * n, patterns, tag_sets, organizations)  # fmt: skip
    claimed = []
    for row in rows:
        attempt_id, token = pairs[row[0] - 1]
        task = task_of(row[1:], required_tags=row[12])
        claimed.append(Claimed(task, Lease(task.id, attempt_id, token, now + lease_s)))
    return claimed


def _claim_arguments(where: ClaimFilter, globs: Sequence[str] | None) -> tuple[Any, Any, Any] | None:
    """The claim function's type patterns, tag sets and organizations for `where`; None if it can match nothing."""
    if where.types == () or where.organizations == ():
        return None
    if where.types is not None:
        patterns: list[str] | None = [leases.exactly(t) for t in where.types]
    else:
        patterns = None if globs is None else [postgres_regex(g) for g in globs]
    tag_sets = json.dumps([sorted(s) for s in where.tag_sets]) if where.tag_sets else None
    return patterns, tag_sets, None if where.organizations is None else list(where.organizations)
