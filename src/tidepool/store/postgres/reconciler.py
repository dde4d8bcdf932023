"""The PostgreSQL store's reconciler passes: expiry, retries due, cancel deadlines, pruning, unserviceable tags.

Each pass takes only rows no other node holds (SKIP LOCKED), in bounded steps: SWEEP rows per
transaction, so no pass holds many rows' locks, or writes much WAL, at once.
"""

from __future__ import annotations

from typing import Any

from ...lifecycle import Event, RetryPolicy, step
from ...model import Lease, State, TaskError, cancel_deadline_error
from ..port import Ended, Expired
from ..rows import error_text
from ..rules import expiry_outcome
from . import scans
from .connection import Connections
from .fenced import expiry, write_ends
from .statements import SQL

SWEEP = 500  # rows per reconciler transaction: bounded locks and WAL per step


class ReconcilerPasses:
    _db: Connections
    _told: scans.Told

    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None, interrupted: frozenset[str] = frozenset(),
                            ) -> list[Expired]:
        args: list[Any]
        if node_id is None:
            sql, args = SQL["expiring"], [now, SWEEP]
        else:
            sql, args = SQL["expiring_of_node"], [node_id, keep_instance, SWEEP]
        expired: list[Expired] = []
        while True:
            moves: scans.Moves = []
            async with self._db.conn(rows=SWEEP) as conn, conn.transaction():
                rows = await conn.fetch(sql, *args)
                ends = [(Lease(r[4], r[5], r[6], now), o, expiry(r, o, policy, now))
                        for r in rows for o in (expiry_outcome(r[5], interrupted),)]
                if ends:
                    await write_ends(conn, ends, now)
                for r, (lease, _, end) in zip(rows, ends, strict=True):
                    if r[8] is not None and end.state.terminal:  # a scan's step: its scan moves on
                        await scans.step_ended(conn, moves, scan_id=r[8], index=r[9], task_id=lease.task_id,
                                               state=end.state, learned=None, now=now)
            self._told(moves)
            expired.extend(Expired(lease.task_id, lease.attempt_id, end.state, r[7])
                           for (lease, _, end), r in zip(ends, rows, strict=True))
            if len(rows) < SWEEP:
                return expired

    async def promote_due(self, *, now: float) -> int:
        async with self._db.conn() as conn:
            promoted = await conn.fetchval(SQL["promote"], now, step(State.RETRY_WAIT, Event.PROMOTE).value)
        return int(promoted)

    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[Ended]:
        error = cancel_deadline_error(deadline_s)
        state = step(State.CANCELLING, Event.CANCEL_ACK).value
        return await self._sweep(SQL["finish_cancels"], now - deadline_s, now, error_text(error), state)

    async def prune(self, *, before: float) -> int:
        pruned = 0
        while True:
            async with self._db.conn(rows=SWEEP) as conn:
                n = int(await conn.fetchval(SQL["prune"], before, SWEEP))
            pruned += n
            if n < SWEEP:
                break
        async with self._db.conn() as conn:
            await conn.execute(SQL["prune_nodes"], before)
        while True:  # the scans ended before `before`, with their jobs (their tasks went above)
            async with self._db.conn(rows=SWEEP) as conn:
                if int(await conn.fetchval(SQL["prune_scans"], before, SWEEP)) < SWEEP:
                    break
        return pruned

    async def queued_tag_sets(self) -> list[frozenset[str]]:
        async with self._db.conn() as conn:
            rows = await conn.fetch(SQL["queued_tag_sets"])
        return [frozenset(r[0]) for r in rows]

    async def fail_unserviceable(self, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
        error = TaskError("unserviceable", message, retryable=False)
        state = step(State.PENDING, Event.UNSERVICEABLE).value
        return await self._sweep(SQL["fail_unserviceable"], sorted(tags), state, error_text(error), now)

    async def _sweep(self, sql: str, *args: Any) -> list[Ended]:
        """Run a statement that ends up to SWEEP tasks and returns their ids and types, until it ends fewer:
        one short transaction each, never one long one holding every row's lock."""
        ended: list[Ended] = []
        while True:
            async with self._db.conn(rows=SWEEP) as conn:
                rows = await conn.fetch(sql, *args, SWEEP)
            ended.extend(Ended(r[0], r[1]) for r in rows)
            if len(rows) < SWEEP:
                return ended
