"""Submitting tasks: inserts, idempotency keys, and the queue's limit."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ...errors import Conflict, StoreUnavailable
from ...model import NewTask, Task, new_id
from ..rows import task_of
from ..rules import batch_answer, check_room
from .connection import Conn
from .statements import SQL


async def add_many(conn: Conn, batch: Sequence[NewTask], keyed: dict[str, NewTask], now: float,
                   max_queued: int | None) -> list[tuple[str, bool]]:
    """add_many's transaction: the keyed tasks that exist already are those tasks (same body), the rest go in."""
    existing: dict[str | None, str] = {}
    if keyed:
        for r in await conn.fetch(SQL["keyed"], list(keyed)):
            if r["fingerprint"] != keyed[r["idempotency_key"]].fingerprint():
                raise Conflict(f"idempotency_key {r['idempotency_key']!r} was used with another body")
            existing[r["idempotency_key"]] = r["id"]
    rows = [insert_args(n, now) for n in batch if n.idempotency_key not in existing]
    if rows:
        if max_queued is not None:
            await check_queue_room(conn, len(rows), max_queued)
        await conn.executemany(SQL["insert_many"], rows)
        await conn.execute(SQL["notify"], str(len(rows)))
    return batch_answer(batch, existing, (r[0] for r in rows))


async def existing(conn: Conn, new: NewTask) -> Task | None:
    """The task that holds new's idempotency key; Conflict when it was submitted with another body."""
    if not new.idempotency_key:
        return None
    row = await conn.fetchrow(SQL["existing"], new.idempotency_key)
    if row is None:
        return None
    if row[-1] != new.fingerprint():
        raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another body")
    return task_of(row, required_tags=row[11])


async def check_queue_room(conn: Conn, n: int, max_queued: int) -> None:
    check_room(await queued(conn, max_queued), n, max_queued)


async def queued(conn: Conn, max_queued: int) -> int:
    """The tasks queued (counted up to max_queued + 1), holding the count until the transaction ends."""
    await conn.execute(SQL["hold_queued"])
    count: int = await conn.fetchval(SQL["queued"], max_queued + 1)
    return count


def insert_args(new: NewTask, now: float, task_id: str | None = None) -> tuple[Any, ...]:
    available_at = new.available_at if new.available_at is not None else now
    return (task_id or new_id(now), new.type, json.dumps(new.payload), new.priority, new.max_attempts, new.timeout_s,
            sorted(new.required_tags), new.idempotency_key, new.fingerprint(), now, available_at,
            new.organization)  # fmt: skip


async def insert(conn: Conn, new: NewTask, now: float) -> tuple[Task, bool]:
    """Insert, or find the task that holds this idempotency key (maybe committed by another node just now)."""
    row = await conn.fetchrow(SQL["insert"], *insert_args(new, now))
    if row is not None:
        return task_of(row, required_tags=row[11]), True
    found = await existing(conn, new)
    if found is None:  # that task was pruned in between: rare enough to report, not to loop on
        raise StoreUnavailable(f"idempotency_key {new.idempotency_key!r} changed hands during the submit; retry")
    return found, False
