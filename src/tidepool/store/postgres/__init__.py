"""The shared PostgreSQL store: the verbs of both ports over one schema that several nodes use at once.

Several nodes share one database, so every guarantee lives in the statements themselves (the .sql
files beside this module): claims take rows with FOR UPDATE SKIP LOCKED, every worker write carries
its fence (attempt id + lease token + live state + unexpired lease) in its WHERE clause, and the
reconciler's passes skip rows another node holds, so no task is claimed, expired, promoted or
cancelled twice. Times are the caller's `now` (epoch seconds), never the server's clock, so every
adapter keeps one contract.

Beside the pool, each node holds one dedicated connection (session.py): its node lock and LISTEN,
for the NOTIFY that every write making tasks claimable sends. Claims and bare completions of many
workers share statements (group.py). Every call ends within a client-side deadline (connection.py).

Driver: asyncpg, chosen by bench/pg_driver.py: with the WAL flush taken out of the figures, it did
1.15-1.8x the claims and 1.5-2.7x the single-row round trips of psycopg 3 (async) on this machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped, unused-ignore]  # typed when asyncpg-stubs is installed
from anyio.abc import TaskStatus

from ... import schedules
from ...errors import Conflict, LeaseLost, ScheduleNotFound, StoreUnavailable, TaskNotFound, TidepoolError
from ...lifecycle import RetryPolicy
from ...model import (
    CANCELLED_ON_REQUEST,
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
from ...scans import NewScan
from ...schedules import Fired, Schedule
from ..notices import Notice
from ..port import Acquired, CancelAnswer, Ending, Enroll, Node, Page, PhaseNote, Revoked
from ..rows import (
    SCHEMA_VERSION,
    attempt_of,
    error_text,
    node_of,
    node_values,
    result_of,
    schedule_of,
    schedule_values,
    task_of,
)
from ..rules import cancel_step, progress_text, retry_step, step_retry_refused
from . import migrations, queue, scans
from .claims import Claims
from .connection import CALL_TIMEOUT_S, CONNECT_TIMEOUT_S, DRIVER_ERRORS, Connections, channel_for, said
from .fenced import FencedWrites, lease_arrays, lost
from .firing import fire
from .notices import Notices
from .reconciler import ReconcilerPasses
from .registry import Registry
from .scan_verbs import ScanVerbs
from .scans import locked_task
from .session import Session
from .statements import SQL

__all__ = ["CALL_TIMEOUT_S", "CONNECT_TIMEOUT_S", "DRIVER_ERRORS", "SCHEMA_VERSION", "PostgresStore", "channel_for"]


class PostgresStore(ScanVerbs, ReconcilerPasses):
    """The store of a fleet. `schema` (else the URL's `?schema=NAME`, else "tidepool") holds its tables,
    so several fleets or test runs can share one database. Each call answers within call_timeout_s (a call
    over many rows, as a batch submit, a millisecond more for each), or raises StoreUnavailable."""

    def __init__(self, url: str, *, schema: str | None = None, max_connections: int = 10,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self._db = Connections(url, schema=schema, max_connections=max_connections,
                               connect_timeout_s=connect_timeout_s, call_timeout_s=call_timeout_s)
        self.url, self.schema, self.channel = self._db.url, self._db.schema, self._db.channel
        self._claims = Claims(self._db)
        self._fenced = FencedWrites(self._db)
        self._notices = Notices()
        self._session = Session(self._db, self._notices)
        self._told = self._fenced.told  # the listener of the scans' moves, however they were made
        self._registry = Registry(self._db, self._notices)

    # lifecycle of the adapter

    async def open(self, *, migrate: bool = True) -> int:
        pool = await self._db.open()
        try:
            with anyio.fail_after(migrations.MIGRATE_TIMEOUT_S):
                async with pool.acquire() as conn:
                    found = await migrations.migrate(conn, self.schema, to=SCHEMA_VERSION, allowed=migrate,
                                                     where=self._db.where)
        except DRIVER_ERRORS as exc:
            pool.terminate()
            raise StoreUnavailable(f"store {self._db.where}: {said(exc)}") from exc
        except BaseException:
            pool.terminate()
            raise
        self._db.start(pool)
        return found

    async def close(self) -> None:
        await self._fenced.drain()
        await self._claims.drain()
        await self._session.close()
        await self._db.close()

    async def write_failure(self) -> str | None:
        """Asked of the server: a failover that left the URL on a standby, or a database set read-only,
        answers every read and refuses every write. A server that does not answer raises, as any read."""
        async with self._db.conn() as conn:
            row = await conn.fetchrow(SQL["takes_writes"])
        if row[0] or row[1] == "on":
            why = "is a standby in recovery" if row[0] else "runs its transactions read-only"
            return f"store {self._db.where}: the server {why}, so every write is refused"
        return None

    # producers

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        async with self._db.conn() as conn:
            if max_queued is None:
                return await queue.insert(conn, new, now)
            async with conn.transaction():
                existing = await queue.existing(conn, new)  # a known task is returned even when the queue is full
                if existing is not None:
                    return existing, False
                await queue.check_queue_room(conn, 1, max_queued)
                return await queue.insert(conn, new, now)

    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[tuple[str, bool]]:
        keyed = {n.idempotency_key: n for n in batch if n.idempotency_key}
        if len(keyed) != sum(1 for n in batch if n.idempotency_key):
            raise Conflict("idempotency_key repeats within the batch")
        async with self._db.conn(rows=len(batch)) as conn:
            try:
                async with conn.transaction():
                    return await queue.add_many(conn, batch, keyed, now, max_queued)
            except asyncpg.UniqueViolationError:
                pass  # a submit of one of the keys, in flight beside this one, committed first: now it is seen
            try:
                async with conn.transaction():
                    return await queue.add_many(conn, batch, keyed, now, max_queued)
            except asyncpg.UniqueViolationError:
                raise Conflict("an idempotency_key of the batch is being used meanwhile; submit it again") from None

    async def get(self, task_id: str) -> Task:
        async with self._db.conn() as conn:
            row = await conn.fetchrow(SQL["get"], task_id)
        if row is None:
            raise TaskNotFound(task_id)
        return replace(_task(row), results=tuple(result_of(r) for r in row[21]))

    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                         cursor: str | None = None, organization: str | None = None) -> Page:
        where, args = ["true"], []
        for condition, value in (("state = ", state), ("type = ", type), ("organization = ", organization),
                                 ("id < ", cursor)):
            if value is not None:
                args.append(str(value))
                where.append(f"{condition}${len(args)}")
        sql = SQL["list_tasks"].format(where=" AND ".join(where), limit=f"${len(args) + 1}")
        async with self._db.conn() as conn:
            rows = await conn.fetch(sql, *args, limit + 1)
        tasks = [_task(r) for r in rows[:limit]]
        return Page(tasks, tasks[-1].id if len(rows) > limit else None)

    async def counts(self) -> dict[State, int]:
        async with self._db.conn() as conn:
            rows = await conn.fetch(SQL["counts"])
        return {State(r[0]): r[1] for r in rows}

    async def organization_counts(self) -> dict[str, int]:
        async with self._db.conn() as conn:
            rows = await conn.fetch(SQL["organization_counts"])
        return {r[0]: r[1] for r in rows}

    async def request_cancel(self, task_id: str, *, now: float) -> CancelAnswer:
        moves: scans.Moves = []
        async with self._db.conn() as conn, conn.transaction():
            answer = await self._cancel_locked(conn, await locked_task(conn, task_id), task_id, now, moves)
        self._told(moves)
        return answer

    async def _cancel_locked(self, conn: Any, row: Any, task_id: str, now: float, moves: scans.Moves) -> CancelAnswer:
        """request_cancel of a task whose row (state, type, scan_id, scan_index) the transaction holds."""
        current, type_ = State(row[0]), row[1]
        target = cancel_step(current)
        if target is current:
            return CancelAnswer(target, False, type_)
        if target is State.CANCELLED:
            await conn.execute(SQL["cancel_queued"], target.value, now, task_id, error_text(CANCELLED_ON_REQUEST))
            if row[2] is not None:  # a scan's step: its scan moves on
                await scans.step_ended(conn, moves, scan_id=row[2], index=row[3], task_id=task_id, state=target,
                                       learned=None, now=now)
        else:
            await conn.execute(SQL["cancel_leased"], target.value, now, task_id)
            await self._notices.remote_cancel(conn, task_id)  # its gateway tells the worker at once
        return CancelAnswer(target, True, type_)

    async def retry(self, task_id: str, *, now: float, max_queued: int | None = None) -> Task:
        async with self._db.conn() as conn, conn.transaction():
            row = await locked_task(conn, task_id)
            target = retry_step(State(row[0]))
            if row[2] is not None:
                raise Conflict(step_retry_refused(task_id, row[2], row[3]))
            if max_queued is not None:
                await queue.check_queue_room(conn, 1, max_queued)
            row = await conn.fetchrow(SQL["retry"], target.value, now, task_id)
        return _task(row)

    # workers

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        return await self._claims.claim(worker, where, limit=limit, now=now, lease_s=lease_s)

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        if not leases:
            return {}
        async with self._db.conn(rows=len(leases)) as conn:
            renewed = await conn.fetch(SQL["renew"], *lease_arrays(leases), now, now + lease_s)
            return await lost(conn, leases, {r[0] for r in renewed})

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        if not notes:
            return {}
        latest = list({n.lease.attempt_id: n for n in notes}.values())  # one row per lease: the last note
        leases = [n.lease for n in latest]
        phases = [n.phase.value for n in latest]
        progress = [progress_text(n.progress) for n in latest]
        async with self._db.conn(rows=len(latest)) as conn:
            noted = await conn.fetch(SQL["set_phase"], *lease_arrays(leases), phases, progress, now)
            return await lost(conn, leases, {r[0] for r in noted})

    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float) -> ResultBatch:
        return await self._fenced.record_result(lease, batch, now)

    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        result = (await self.finish_many([Ending(lease, outcome, now)], policy=policy))[0]
        if isinstance(result, TidepoolError):
            raise result
        return result

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        return await self._fenced.finish_many(endings, policy)

    # schedules

    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        async with self._db.conn() as conn, conn.transaction():
            saved = schedules.merge(await _locked_schedule(conn, schedule.name), schedule, now)
            await conn.execute(SQL["save_schedule"], *schedule_values(saved))
        return saved

    async def list_schedules(self) -> list[Schedule]:
        async with self._db.conn() as conn:
            rows = await conn.fetch(SQL["list_schedules"])
        return [schedule_of(r) for r in rows]

    async def delete_schedule(self, name: str, *, config_node: str | None = None) -> None:
        async with self._db.conn() as conn:
            if await conn.fetchval(SQL["delete_schedule"], name, config_node) is None:
                raise ScheduleNotFound(name)

    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule:
        async with self._db.conn() as conn, conn.transaction():
            existing = await _locked_schedule(conn, name)
            if existing is None:
                raise ScheduleNotFound(name)
            saved = schedules.set_paused(existing, paused, now)
            await conn.execute(SQL["save_schedule"], *schedule_values(saved))
        return saved

    async def fire_schedules(self, *, now: float,
                             new_task: Callable[[Schedule, float], NewTask | NewScan] | None = None,
                             defines: Callable[[Schedule], bool] = lambda schedule: True,
                             max_queued: int | None = None) -> list[Fired]:
        async with self._db.conn() as conn:
            due = await conn.fetch(SQL["due_schedules"], now)
        fired: list[Fired] = []
        for name, spec in due:
            if not defines(Schedule(name, **schedules.stored_spec(spec))):
                continue  # a node that defines the type fires it
            async with self._db.conn() as conn, conn.transaction():  # each a call of its own, within the deadline
                these = await fire(conn, name, now, new_task, max_queued)
                if created := sum(1 for f in these if f.task_id is not None or f.scan_id is not None):
                    await conn.execute(SQL["notify"], str(created))
            fired.extend(these)
        return fired

    # the fleet

    async def lock_node(self, node_id: str, instance_id: str) -> None:
        await self._session.lock_node(node_id, instance_id)

    async def save_node(self, node: Node) -> None:
        async with self._db.conn() as conn:
            await conn.execute(SQL["save_node"], *node_values(node, task_types=list(node.task_types)))

    async def list_nodes(self) -> list[Node]:
        async with self._db.conn() as conn:
            rows = await conn.fetch(SQL["list_nodes"])
        return [node_of(r, task_types=r[9]) for r in rows]

    async def watch(self, wake: Callable[[int], None], *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self._session.watch(wake, task_status=task_status)

    def hear_notices(self, heard: Callable[[Notice], None]) -> None:
        self._notices.hear(heard)

    # the worker registry (registry.py)

    async def meet_worker(self, identity: str, *, cert: CertSeen, address: str | None, now: float,
                          enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
        return await self._registry.meet(identity, cert=cert, address=address, now=now, enroll=enroll,
                                         max_concurrent_tasks=max_concurrent_tasks)

    async def list_workers(self) -> list[RemoteWorker]:
        return await self._registry.all()

    async def get_worker(self, worker_id: str) -> RemoteWorker:
        return await self._registry.get(worker_id)

    async def change_worker(self, worker_id: str, change: WorkerChange, *,
                            now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return await self._registry.change(worker_id, change, now=now)

    async def revoke_worker(self, worker_id: str, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
        return await self._registry.revoke(worker_id, now=now)

    async def acquire(self, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                      worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
        return await self._registry.acquire(identity, where, limit=limit, now=now, lease_s=lease_s,
                                            worker_id=worker_id, slots=slots, version=version)

    async def attempt_owners(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        return await self._registry.attempt_owners(attempt_ids)


async def _locked_schedule(conn: Any, name: str) -> Schedule | None:
    row = await conn.fetchrow(SQL["locked_schedule"], name)
    return None if row is None else schedule_of(row)


def _task(row: Any) -> Task:
    """A task from a row of its columns followed by its attempts."""
    return task_of(row, required_tags=row[11], attempts=tuple(attempt_of(a) for a in row[20]))
