"""The queue's tasks: submits (idempotency keys, the queue's limit), reads, cancels and retries.

The other nouns build on this module, so what a task's cancel moves beyond the task's row is given to
it by them (Cancel): a queued step's end moves its scan on, and a remote worker's attempt is told to its
gateway.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import asyncpg  # type: ignore[import-untyped, unused-ignore]  # typed when asyncpg-stubs is installed

from ...errors import Conflict, StoreUnavailable, TaskNotFound
from ...model import CANCELLED_ON_REQUEST, NewTask, State, Task, new_id
from .. import sql
from ..port import CancelAnswer, Page, ScanMove
from ..rows import TASK_WIDTH, artifact_of, attempt_of, error_text, result_of, task_of
from ..rules import batch_answer, cancel_step, check_inputs, check_room, retry_step, step_retry_refused
from .database import Conn, Database

SQL = sql.queries(__package__, "tasks.sql")


class StepEnded(Protocol):
    """A scan's move when the task of its job `index` ended as `state` (scans.step_ended)."""

    async def __call__(self, conn: Conn, moves: list[ScanMove], *, scan_id: str, index: int, task_id: str,
                       state: State, learned: dict[str, Any] | None, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Cancel:
    """A task's cancel, inside the transaction that holds its row (locked_task): a queued task ends now, a
    leased or running one becomes cancelling. `step_ended` moves a queued step's scan on; `remote_cancel`
    tells the gateway of a remote worker that holds the task."""

    step_ended: StepEnded
    remote_cancel: Callable[[Conn, str], Awaitable[None]]

    async def __call__(self, conn: Conn, row: Any, task_id: str, now: float, moves: list[ScanMove]) -> CancelAnswer:
        """The cancel of a task whose row (state, type, scan_id, scan_index) the transaction holds."""
        current, type_ = State(row[0]), row[1]
        target = cancel_step(current)
        if target is current:
            return CancelAnswer(target, False, type_)
        if target is State.CANCELLED:
            await conn.execute(SQL["cancel_queued"], target.value, now, task_id, error_text(CANCELLED_ON_REQUEST))
            if row[2] is not None:  # a scan's step: its scan moves on
                await self.step_ended(conn, moves, scan_id=row[2], index=row[3], task_id=task_id, state=target,
                                      learned=None, now=now)
        else:
            await conn.execute(SQL["cancel_leased"], target.value, now, task_id)
            await self.remote_cancel(conn, task_id)  # its gateway tells the worker at once
        return CancelAnswer(target, True, type_)


# submits


async def add(db: Database, new: NewTask, *, now: float, max_queued: int | None) -> tuple[Task, bool]:
    async with db.conn() as conn:
        if max_queued is None and not new.inputs:
            return await _insert(conn, new, now)
        async with conn.transaction():
            if max_queued is not None:
                found = await _existing(conn, new)  # a known task is returned even when the queue is full
                if found is not None:
                    return found, False
                await check_queue_room(conn, 1, max_queued)
            return await _insert(conn, new, now)


async def add_many(db: Database, batch: Sequence[NewTask], *, now: float,
                   max_queued: int | None) -> list[tuple[str, bool]]:
    keyed = {n.idempotency_key: n for n in batch if n.idempotency_key}
    if len(keyed) != sum(1 for n in batch if n.idempotency_key):
        raise Conflict("idempotency_key repeats within the batch")
    async with db.conn(rows=len(batch)) as conn:
        try:
            async with conn.transaction():
                return await _add_many(conn, batch, keyed, now, max_queued)
        except asyncpg.UniqueViolationError:
            pass  # a submit of one of the keys, in flight beside this one, committed first: now it is seen
        try:
            async with conn.transaction():
                return await _add_many(conn, batch, keyed, now, max_queued)
        except asyncpg.UniqueViolationError:
            raise Conflict("an idempotency_key of the batch is being used meanwhile; submit it again") from None


async def _add_many(conn: Conn, batch: Sequence[NewTask], keyed: dict[str, NewTask], now: float,
                    max_queued: int | None) -> list[tuple[str, bool]]:
    """add_many's transaction: the keyed tasks that exist already are those tasks (same body), the rest go in."""
    known: dict[str | None, str] = {}
    if keyed:
        for r in await conn.fetch(SQL["keyed"], list(keyed)):
            if r["fingerprint"] != keyed[r["idempotency_key"]].fingerprint():
                raise Conflict(f"idempotency_key {r['idempotency_key']!r} was used with another body")
            known[r["idempotency_key"]] = r["id"]
    fresh = [n for n in batch if n.idempotency_key not in known]
    rows = [_insert_args(n, now) for n in fresh]
    if rows:
        if max_queued is not None:
            await check_queue_room(conn, len(rows), max_queued)
        await hold_inputs(conn, [n.inputs for n in fresh])
        await conn.executemany(SQL["insert_many"], rows)
        await insert_inputs(conn, [(r[0], n.inputs) for r, n in zip(rows, fresh, strict=True)])
        await notify(conn, len(rows))
    return batch_answer(batch, known, (r[0] for r in rows))


async def _existing(conn: Conn, new: NewTask) -> Task | None:
    """The task that holds new's idempotency key; Conflict when it was submitted with another body."""
    if not new.idempotency_key:
        return None
    row = await conn.fetchrow(SQL["existing"], new.idempotency_key)
    if row is None:
        return None
    if row[-1] != new.fingerprint():
        raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another body")
    return task_of(row, required_tags=row[11])


async def _insert(conn: Conn, new: NewTask, now: float) -> tuple[Task, bool]:
    """Insert, or find the task that holds this idempotency key (maybe committed by another node just now).
    A task with inputs is inserted inside the caller's transaction."""
    await hold_inputs(conn, [new.inputs])
    row = await conn.fetchrow(SQL["insert"], *_insert_args(new, now))
    if row is not None:
        await insert_inputs(conn, [(row[0], new.inputs)])
        return task_of(row, required_tags=row[11]), True
    found = await _existing(conn, new)
    if found is None:  # that task was pruned in between: rare enough to report, not to loop on
        raise StoreUnavailable(f"idempotency_key {new.idempotency_key!r} changed hands during the submit; retry")
    return found, False


async def inserted(conn: Conn, new: NewTask, now: float, task_id: str) -> bool:
    """Insert `new` as task `task_id`, notified at commit; False when its idempotency key is taken already."""
    await hold_inputs(conn, [new.inputs])
    if await conn.fetchrow(SQL["insert"], *_insert_args(new, now, task_id)) is None:
        return False
    await insert_inputs(conn, [(task_id, new.inputs)])
    return True


async def hold_inputs(conn: Conn, inputs: Sequence[Mapping[str, str]]) -> None:
    """InvalidRequest naming the first input that is no blob. The blobs named are held until the caller's
    transaction ends, so a pruning beside it either skips them or deleted them first: never a task that
    names a blob gone."""
    named = sorted({sha for each in inputs for sha in each.values()})
    if not named:
        return
    known = {r[0] for r in await conn.fetch(SQL["hold_blobs"], named)}
    for each in inputs:
        check_inputs(each, known)


async def insert_inputs(conn: Conn, inputs: Sequence[tuple[str, Mapping[str, str]]]) -> None:
    """The rows that name each task's input blobs: their foreign keys hold the blobs against the pruning."""
    rows = [(task_id, name, sha) for task_id, named in inputs for name, sha in named.items()]
    if rows:
        await conn.execute(SQL["insert_inputs"], *(list(column) for column in zip(*rows, strict=True)))


def _insert_args(new: NewTask, now: float, task_id: str | None = None) -> tuple[Any, ...]:
    available_at = new.available_at if new.available_at is not None else now
    return (task_id or new_id(now), new.type, json.dumps(new.payload), new.priority, new.max_attempts, new.timeout_s,
            sorted(new.required_tags), new.idempotency_key, new.fingerprint(), now, available_at,
            new.organization, json.dumps(new.inputs))  # fmt: skip


async def check_queue_room(conn: Conn, n: int, max_queued: int) -> None:
    check_room(await queued(conn, max_queued), n, max_queued)


async def queued(conn: Conn, max_queued: int) -> int:
    """The tasks queued (counted up to max_queued + 1), holding the count until the transaction ends."""
    await conn.execute(SQL["hold_queued"])
    count: int = await conn.fetchval(SQL["queued"], max_queued + 1)
    return count


async def notify(conn: Conn, n: int) -> None:
    """Wake the nodes' workers for `n` tasks made claimable, at commit."""
    await conn.execute(SQL["notify"], str(n))


# reads


async def get(db: Database, task_id: str) -> Task:
    async with db.conn() as conn:
        row = await conn.fetchrow(SQL["get"], task_id)
    if row is None:
        raise TaskNotFound(task_id)
    return replace(_task(row), results=tuple(result_of(r) for r in row[TASK_WIDTH + 1]),
                   artifacts=tuple(artifact_of(a) for a in row[TASK_WIDTH + 2]))


async def list_tasks(db: Database, *, state: State | None, type: str | None, limit: int, cursor: str | None,
                     organization: str | None) -> Page:
    where, args = ["true"], []
    for condition, value in (("state = ", state), ("type = ", type), ("organization = ", organization),
                             ("id < ", cursor)):
        if value is not None:
            args.append(str(value))
            where.append(f"{condition}${len(args)}")
    statement = SQL["list_tasks"].format(where=" AND ".join(where), limit=f"${len(args) + 1}")
    async with db.conn() as conn:
        rows = await conn.fetch(statement, *args, limit + 1)
    tasks = [_task(r) for r in rows[:limit]]
    return Page(tasks, tasks[-1].id if len(rows) > limit else None)


async def counts(db: Database) -> dict[State, int]:
    async with db.conn() as conn:
        rows = await conn.fetch(SQL["counts"])
    return {State(r[0]): r[1] for r in rows}


async def organization_counts(db: Database) -> dict[str, int]:
    async with db.conn() as conn:
        rows = await conn.fetch(SQL["organization_counts"])
    return {r[0]: r[1] for r in rows}


def _task(row: Any) -> Task:
    """A task from a row of its columns followed by its attempts."""
    return task_of(row, required_tags=row[11], attempts=tuple(attempt_of(a) for a in row[TASK_WIDTH]))


# cancels and retries


async def request_cancel(db: Database, task_id: str, *, now: float, cancel: Cancel,
                         told: Callable[[list[ScanMove]], None]) -> CancelAnswer:
    moves: list[ScanMove] = []
    async with db.conn() as conn, conn.transaction():
        answer = await cancel(conn, await locked_task(conn, task_id), task_id, now, moves)
    told(moves)
    return answer


async def retry(db: Database, task_id: str, *, now: float, max_queued: int | None) -> Task:
    async with db.conn() as conn, conn.transaction():
        row = await locked_task(conn, task_id)
        target = retry_step(State(row[0]))
        if row[2] is not None:
            raise Conflict(step_retry_refused(task_id, row[2], row[3]))
        if max_queued is not None:
            await check_queue_room(conn, 1, max_queued)
        row = await conn.fetchrow(SQL["retry"], target.value, now, task_id)
    return _task(row)


async def locked_task(conn: Conn, task_id: str) -> Any:
    """A task's (state, type, scan_id, scan_index), its row locked until the transaction ends."""
    row = await conn.fetchrow(SQL["lock_state"], task_id)
    if row is None:
        raise TaskNotFound(task_id)
    return row
