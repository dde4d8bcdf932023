"""The worker registry of the PostgreSQL store, which several gateways may share.

Each write of a record runs in one transaction that locks the worker's row first (registry.sql): two
acquires of one worker through two gateways take turns, so the second counts the first's leases against
the cap; the claim function's SKIP LOCKED keeps any task from being leased twice.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
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
from .claims import exactly
from .connection import Conn, Connections
from .notices import Notices
from .statements import SQL

CANCELLING = step(State.RUNNING, Event.CANCEL).value  # where a cancel moves a leased or running task


def _worker(row: Any) -> RemoteWorker:
    return worker_of(row, task_types=row[3], organizations=row[4], live=row[11])


def _values(w: RemoteWorker) -> tuple[Any, ...]:
    return worker_values(w, lists=list)


class Registry:
    def __init__(self, db: Connections, notices: Notices) -> None:
        self._db = db
        self._notices = notices

    async def meet(self, identity: str, *, cert: CertSeen, address: str | None, now: float, enroll: Enroll,
                   max_concurrent_tasks: int) -> RemoteWorker:
        async with self._db.conn() as conn, conn.transaction():
            if await conn.fetchval(SQL["is_node"], identity) is not None:
                raise node_taken(identity)
            first = first_record(identity, cert, address, now, enroll, max_concurrent_tasks)
            if await conn.fetchval(SQL["first_contact"], *_values(first)) is None:
                await conn.execute(SQL["save_worker"], *_values(met_again(await _locked(conn, identity), cert,
                                                                          address, now)))
            return await _read(conn, identity)

    async def all(self) -> list[RemoteWorker]:
        async with self._db.conn() as conn:
            return [_worker(r) for r in await conn.fetch(SQL["workers"])]

    async def get(self, worker_id: str) -> RemoteWorker:
        async with self._db.conn() as conn:
            return await _read(conn, worker_id)

    async def change(self, worker_id: str, change: WorkerChange, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
        async with self._db.conn() as conn, conn.transaction():
            before = await _locked(conn, worker_id)
            after = changed(before, change)
            await conn.execute(SQL["save_worker"], *_values(after))
            keep = spared(after, change)
            cancelled = await _cancel_held(conn, worker_id, now, keep) if keep is not None else []
            await self._notices.worker_changed(conn, after, cancelled)
            return await _read(conn, worker_id), cancelled

    async def revoke(self, worker_id: str, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
        async with self._db.conn() as conn, conn.transaction():
            known = await _locked(conn, worker_id)
            if known.state is WorkerState.REVOKED:
                return known, []
            revoked = dataclasses.replace(known, state=WorkerState.REVOKED)
            await conn.execute(SQL["save_worker"], *_values(revoked))
            cancelled = await _cancel_held(conn, worker_id, now, None)
            await self._notices.worker_changed(conn, revoked, cancelled)
            return await _read(conn, worker_id), cancelled

    async def acquire(self, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                      worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
        idle = await self._nothing_to_acquire(identity, where, limit, now, slots, version)
        if idle is not None:
            return idle
        async with self._db.conn(rows=max(limit, 0)) as conn, conn.transaction():
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

    async def _nothing_to_acquire(self, identity: str, where: ClaimFilter, limit: int, now: float,
                                  slots: Sequence[Sequence[str]], version: str | None) -> Acquired | None:
        """Without a transaction: the answer of an acquire that would write nothing (the record need not be
        saved, no row is claimable to it), or None when it must lock. Nothing is leased from this read, so the
        state, cap, globs and organizations that lease are still decided under the worker's row lock."""
        async with self._db.conn() as conn:
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

    async def attempt_owners(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        if not attempt_ids:
            return {}
        async with self._db.conn() as conn:
            return {r[0]: r[1] for r in await conn.fetch(SQL["attempt_owners"], list(attempt_ids))}


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
    leases = [(new_id(now), new_token()) for _ in range(n)]
    rows = await conn.fetch(
        SQL["claim"], now, n, [a for a, _ in leases], [t for _, t in leases], [identity] * n, [REMOTE_INSTANCE] * n,
        [worker_id] * n, [now] * n, [now + lease_s] * n, patterns, tag_sets, organizations)  # fmt: skip
    claimed = []
    for row in rows:
        attempt_id, token = leases[row[0] - 1]
        task = task_of(row[1:], required_tags=row[12])
        claimed.append(Claimed(task, Lease(task.id, attempt_id, token, now + lease_s)))
    return claimed


def _claim_arguments(where: ClaimFilter, globs: Sequence[str] | None) -> tuple[Any, Any, Any] | None:
    """The claim function's type patterns, tag sets and organizations for `where`; None if it can match nothing."""
    if where.types == () or where.organizations == ():
        return None
    if where.types is not None:
        patterns: list[str] | None = [exactly(t) for t in where.types]
    else:
        patterns = None if globs is None else [postgres_regex(g) for g in globs]
    tag_sets = json.dumps([sorted(s) for s in where.tag_sets]) if where.tag_sets else None
    return patterns, tag_sets, None if where.organizations is None else list(where.organizations)
