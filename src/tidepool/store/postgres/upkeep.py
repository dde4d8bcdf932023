"""The upkeep: the reconciler's passes (expiry, retries due, cancel deadlines, pruning, unserviceable tags)
and the fleet of nodes.

Each pass takes only rows no other node holds (SKIP LOCKED), in bounded steps: SWEEP rows per
transaction, so no pass holds many rows' locks, or writes much WAL, at once. A node's lock is held by
its dedicated session (database.Session), which takes it again after a reconnect.
"""

from __future__ import annotations

from typing import Any

from ...lifecycle import Event, RetryPolicy, step
from ...model import AttemptStatus, Lease, State, TaskError, cancel_deadline_error
from .. import sql
from ..bounds import expiry
from ..port import Ended, Expired, Node
from ..rows import error_text, node_of, node_values
from . import leases, scans
from .database import Database, Session

SQL = sql.queries(__package__, "upkeep.sql")
SWEEP = 500  # rows per reconciler transaction: bounded locks and WAL per step


# the reconciler's passes


async def expire_leases(db: Database, *, now: float, policy: RetryPolicy, node_id: str | None,
                        keep_instance: str | None, interrupted: frozenset[str], told: scans.Told,
                        retry_on_timeout: frozenset[str] = frozenset()) -> list[Expired]:
    args: list[Any]
    if node_id is None:
        statement, args = SQL["expiring"], [now, SWEEP]
    else:
        statement, args = SQL["expiring_of_node"], [node_id, keep_instance, SWEEP]
    expired: list[Expired] = []
    while True:
        moves: scans.Moves = []
        async with db.conn(rows=SWEEP) as conn, conn.transaction():
            rows = await conn.fetch(statement, *args)
            ends = [(Lease(r[4], r[5], r[6], now), o, leases.expiry(r, o, policy, now))
                    for r in rows for o in (expiry(r[5], interrupted=interrupted, lease_expires_at=r[10],
                                                   deadline_at=r[11], type=r[7], retry_on_timeout=retry_on_timeout),)]
            if ends:
                await leases.write_ends(conn, ends, now)
            for r, (lease, _, end) in zip(rows, ends, strict=True):
                if r[8] is not None and end.state.terminal:  # a scan's step: its scan moves on
                    await scans.step_ended(conn, moves, scan_id=r[8], index=r[9], task_id=lease.task_id,
                                           state=end.state, learned=None, now=now)
        told(moves)
        expired.extend(Expired(lease.task_id, lease.attempt_id, end.state, r[7],
                               timed_out=outcome.status is AttemptStatus.TIMED_OUT)
                       for (lease, outcome, end), r in zip(ends, rows, strict=True))
        if len(rows) < SWEEP:
            return expired


async def promote_due(db: Database, *, now: float) -> int:
    async with db.conn() as conn:
        promoted = await conn.fetchval(SQL["promote"], now, step(State.RETRY_WAIT, Event.PROMOTE).value)
    return int(promoted)


async def finish_cancels(db: Database, *, now: float, deadline_s: float) -> list[Ended]:
    error = cancel_deadline_error(deadline_s)
    state = step(State.CANCELLING, Event.CANCEL_ACK).value
    return await _sweep(db, SQL["finish_cancels"], now - deadline_s, now, error_text(error), state)


async def prune(db: Database, *, before: float) -> int:
    pruned = 0
    while True:
        async with db.conn(rows=SWEEP) as conn:
            n = int(await conn.fetchval(SQL["prune"], before, SWEEP))
        pruned += n
        if n < SWEEP:
            break
    async with db.conn() as conn:
        await conn.execute(SQL["prune_nodes"], before)
    while True:  # the scans ended before `before`, with their jobs (their tasks went above)
        async with db.conn(rows=SWEEP) as conn:
            if int(await conn.fetchval(SQL["prune_scans"], before, SWEEP)) < SWEEP:
                break
    return pruned


async def queued_tag_sets(db: Database) -> list[frozenset[str]]:
    async with db.conn() as conn:
        rows = await conn.fetch(SQL["queued_tag_sets"])
    return [frozenset(r[0]) for r in rows]


async def fail_unserviceable(db: Database, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
    error = TaskError("unserviceable", message, retryable=False)
    state = step(State.PENDING, Event.UNSERVICEABLE).value
    return await _sweep(db, SQL["fail_unserviceable"], sorted(tags), state, error_text(error), now)


async def _sweep(db: Database, statement: str, *args: Any) -> list[Ended]:
    """Run a statement that ends up to SWEEP tasks and returns their ids and types, until it ends fewer:
    one short transaction each, never one long one holding every row's lock."""
    ended: list[Ended] = []
    while True:
        async with db.conn(rows=SWEEP) as conn:
            rows = await conn.fetch(statement, *args, SWEEP)
        ended.extend(Ended(r[0], r[1]) for r in rows)
        if len(rows) < SWEEP:
            return ended


# the fleet


async def save_node(db: Database, node: Node) -> None:
    async with db.conn() as conn:
        await conn.execute(SQL["save_node"], *node_values(node, task_types=list(node.task_types)))


async def lock_node(session: Session, node_id: str, instance_id: str) -> None:
    await session.lock_node(node_id, instance_id)


async def list_nodes(db: Database) -> list[Node]:
    async with db.conn() as conn:
        rows = await conn.fetch(SQL["list_nodes"])
    return [node_of(r, task_types=r[9]) for r in rows]
