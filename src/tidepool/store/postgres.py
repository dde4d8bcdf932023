"""The shared PostgreSQL store: its schema, its SQL, and the grouping of many workers' writes.

Several nodes share one database, so every guarantee lives in the statements themselves: claims
take rows with FOR UPDATE SKIP LOCKED, every worker write carries its fence (attempt id + lease
token + live state + unexpired lease) in its WHERE clause, and the reconciler's passes skip rows
another node holds, so no task is claimed, expired, promoted or cancelled twice. Times are the
caller's `now` (epoch seconds), never the server's clock, so every adapter keeps one contract.

Driver: asyncpg, chosen by bench/pg_driver.py (on par with psycopg 3 where the server does the
work, ~1.4x faster on single-row round trips here).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import anyio
import asyncpg  # type: ignore[import-untyped, unused-ignore]  # asyncpg-stubs, when installed, types it

from ..errors import ConfigError, Conflict, LeaseLost, QueueFull, StoreUnavailable, TaskCancelling, TaskNotFound
from ..lifecycle import Ending, Event, RetryPolicy, decide_end, step
from ..model import (
    Attempt,
    AttemptStatus,
    Claimed,
    ClaimFilter,
    Lease,
    NewTask,
    Outcome,
    Phase,
    ResultBatch,
    State,
    Task,
    TaskError,
    Worker,
    new_id,
    new_token,
)
from . import Expired, Page, PhaseNote, cancel_step, retry_step

I = TypeVar("I")  # noqa: E741  # an item queued for a grouped write
R = TypeVar("R")
Conn = Any  # asyncpg.Connection; Any keeps the module typed the same with and without asyncpg-stubs

# What the driver raises when the server is away or the statement failed: all become StoreUnavailable.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError, TimeoutError)
SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
MAX_GROUP = 256  # calls per grouped statement
SWEEP = 500  # rows per reconciler transaction: bounded locks and WAL per step

SCHEMA_VERSION = 1
MIGRATIONS = {
    1: """
CREATE TABLE {s}.schema_version (version integer PRIMARY KEY, applied_at double precision NOT NULL);
CREATE TABLE {s}.tasks (
    id text PRIMARY KEY,
    type text NOT NULL,
    payload text NOT NULL,              -- JSON kept verbatim: jsonb refuses \\u0000, sqlite does not
    priority bigint NOT NULL,
    state text NOT NULL CHECK (state IN ('pending', 'leased', 'running', 'retry_wait', 'cancelling',
                                         'completed', 'failed', 'timed_out', 'cancelled')),
    phase text,
    progress text,
    attempt integer NOT NULL DEFAULT 0,
    attempt_rows integer NOT NULL DEFAULT 0,  -- numbers attempts[] under the row lock, never recounted
    max_attempts integer NOT NULL,
    interruptions integer NOT NULL DEFAULT 0,
    timeout_s double precision,
    required_tags text[] NOT NULL DEFAULT '{{}}',
    idempotency_key text UNIQUE,
    fingerprint text NOT NULL,
    node_id text,
    error text,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    available_at double precision NOT NULL,
    finished_at double precision,
    lease_attempt_id text,
    lease_token text,
    lease_expires_at double precision,
    lease_instance text,
    cancel_requested_at double precision
);
CREATE INDEX tasks_queue ON {s}.tasks (priority DESC, created_at, id) WHERE state IN ('pending', 'retry_wait');
CREATE INDEX tasks_leases ON {s}.tasks (lease_expires_at) WHERE state IN ('leased', 'running', 'cancelling');
CREATE INDEX tasks_node_leases ON {s}.tasks (node_id) WHERE state IN ('leased', 'running', 'cancelling');
CREATE INDEX tasks_cancelling ON {s}.tasks (cancel_requested_at) WHERE state = 'cancelling';
CREATE INDEX tasks_retry_due ON {s}.tasks (available_at) WHERE state = 'retry_wait';
CREATE INDEX tasks_state ON {s}.tasks (state, id);
CREATE INDEX tasks_type ON {s}.tasks (type, id);
CREATE INDEX tasks_finished ON {s}.tasks (finished_at) WHERE finished_at IS NOT NULL;
CREATE TABLE {s}.attempts (
    id text PRIMARY KEY,
    task_id text NOT NULL,
    number integer NOT NULL,
    node_id text NOT NULL,
    instance_id text NOT NULL,
    worker_id text NOT NULL,
    status text NOT NULL,
    started_at double precision NOT NULL,
    finished_at double precision,
    error text,
    exit_status integer,
    stderr_tail text
);
CREATE INDEX attempts_task ON {s}.attempts (task_id, number);
CREATE TABLE {s}.results (
    idempotency_key text PRIMARY KEY,
    task_id text NOT NULL,
    attempt_id text NOT NULL,
    plugin text NOT NULL,
    sequence integer NOT NULL,
    sha256 text NOT NULL,
    final boolean NOT NULL,
    payload text NOT NULL,
    created_at double precision NOT NULL
);
CREATE INDEX results_task ON {s}.results (task_id, created_at);
""",
}

TASK_COLUMNS = ("id, type, payload, priority, state, phase, progress, attempt, max_attempts, interruptions, "
                "timeout_s, required_tags, idempotency_key, node_id, error, created_at, updated_at, "
                "available_at, finished_at")
ATTEMPTS = ("ARRAY(SELECT ROW(a.id, a.task_id, a.number, a.node_id, a.worker_id, a.status, a.started_at, "
            "a.finished_at, a.error, a.exit_status, a.stderr_tail) FROM attempts a WHERE a.task_id = t.id "
            "ORDER BY a.number)")
RESULTS = ("ARRAY(SELECT ROW(r.plugin, r.sequence, r.idempotency_key, r.sha256, r.final, r.payload) "
           "FROM results r WHERE r.task_id = t.id ORDER BY r.created_at, r.sequence)")
LIVE = "state IN ('leased', 'running')"
TERMINAL_SQL = "state IN ('completed', 'failed', 'timed_out', 'cancelled')"
# Multi-row fenced writes lock their rows in id order first: two of them over overlapping tasks
# (a renewal racing a grouped completion) then queue behind each other instead of deadlocking.
LEASES = "unnest($1::text[], $2::text[], $3::text[]{types}) AS l(id, attempt_id, token{names})"
FENCED = ("SELECT t.id{cols} FROM tasks t JOIN l ON t.id = l.id AND t.lease_attempt_id = l.attempt_id "
          "AND t.lease_token = l.token WHERE t.state IN ('leased', 'running') AND t.lease_expires_at > {now} "
          "ORDER BY t.id FOR NO KEY UPDATE OF t")


class PostgresStore:
    def __init__(self, url: str, *, schema: str = "tidepool", max_connections: int = 10,
                 command_timeout_s: float = 30.0, connect_timeout_s: float = 10.0) -> None:
        if not SCHEMA_NAME.fullmatch(schema):
            raise ConfigError(f"config: store schema {schema!r} is not a plain SQL name (letters, digits, _)")
        self.url = url
        self.schema = schema
        self._max_connections = max_connections
        self._command_timeout_s = command_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._pool: Any = None
        self._claims: dict[ClaimFilter, _Group[_ClaimCall, list[Claimed]]] = {}
        self._completions = _Group(self._complete_group)
        parts = urlsplit(url)
        self._where = f"{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path} schema {schema}"

    # lifecycle of the adapter

    async def open(self, *, migrate: bool = True) -> None:
        try:
            pool = await asyncpg.create_pool(
                self.url, min_size=1, max_size=self._max_connections, timeout=self._connect_timeout_s,
                command_timeout=self._command_timeout_s,
                server_settings={"search_path": f'"{self.schema}"', "application_name": "tidepool", "jit": "off"})
        except DRIVER_ERRORS as exc:
            raise StoreUnavailable(f"store {self._where}: cannot connect: {exc}") from exc
        try:
            async with pool.acquire() as conn:
                await self._migrate(conn, migrate)
        except DRIVER_ERRORS as exc:
            pool.terminate()
            raise StoreUnavailable(f"store {self._where}: {exc}") from exc
        except BaseException:
            pool.terminate()
            raise
        self._pool = pool

    async def close(self) -> None:
        await self._completions.drain()
        for group in list(self._claims.values()):
            await group.drain()
        pool, self._pool = self._pool, None
        if pool is not None:
            with anyio.move_on_after(self._command_timeout_s, shield=True):
                await pool.close()
            pool.terminate()  # a no-op after a clean close; ends connections stuck past the timeout

    async def _migrate(self, conn: Conn, migrate: bool) -> None:
        async with conn.transaction():
            if migrate:  # two nodes starting together: the second waits, then finds the schema current
                await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                                   f"tidepool.migrate.{self.schema}")
            version = await _schema_version(conn, self.schema)
            if version > SCHEMA_VERSION:
                raise StoreUnavailable(f"store {self._where} has schema version {version}, newer than this "
                                       f"tidepool understands ({SCHEMA_VERSION}): upgrade tidepool")
            if version == SCHEMA_VERSION:
                return
            if not migrate:
                raise StoreUnavailable(f"store {self._where} has schema version {version}, needs "
                                       f"{SCHEMA_VERSION}: run `tidepool migrate`")
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            for v in range(version + 1, SCHEMA_VERSION + 1):
                await conn.execute(MIGRATIONS[v].format(s=f'"{self.schema}"'))
                await conn.execute(f'INSERT INTO "{self.schema}".schema_version VALUES ($1, '
                                   "extract(epoch FROM clock_timestamp()))", v)

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[Conn]:
        """A pooled connection; driver errors leave as StoreUnavailable with the original as cause."""
        if self._pool is None:
            raise StoreUnavailable("the store is not open")
        try:
            async with self._pool.acquire() as conn:
                yield conn
        except DRIVER_ERRORS as exc:
            raise StoreUnavailable(f"store {self._where}: {type(exc).__name__}: {exc}") from exc

    # producers

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        async with self._conn() as conn:
            if max_queued is None:
                return await _insert(conn, new, now)
            async with conn.transaction():
                existing = await _existing(conn, new)
                if existing is not None:
                    return existing, False
                await _check_room(conn, 1, max_queued)
                return await _insert(conn, new, now)

    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[str]:
        keys = [n.idempotency_key for n in batch if n.idempotency_key]
        if len(keys) != len(set(keys)):
            raise Conflict("idempotency_key repeats within the batch")
        rows = [(new_id(now), n.type, json.dumps(n.payload), n.priority, n.max_attempts, n.timeout_s,
                 sorted(n.required_tags), n.idempotency_key, n.fingerprint(), now,
                 n.available_at if n.available_at is not None else now) for n in batch]
        async with self._conn() as conn, conn.transaction():
            if keys and await conn.fetchval("SELECT 1 FROM tasks WHERE idempotency_key = ANY($1::text[]) LIMIT 1",
                                            keys):
                raise Conflict("an idempotency_key of the batch is already used")
            if max_queued is not None:
                await _check_room(conn, len(batch), max_queued)
            try:
                await conn.executemany(
                    "INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags, "
                    "idempotency_key, fingerprint, created_at, updated_at, available_at) "
                    "VALUES ($1, $2, $3, $4, 'pending', $5, $6, $7, $8, $9, $10, $10, $11)", rows)
            except asyncpg.UniqueViolationError:  # a concurrent submit took a key since the check
                raise Conflict("an idempotency_key of the batch is already used") from None
        return [r[0] for r in rows]

    async def get(self, task_id: str) -> Task:
        async with self._conn() as conn:
            row = await conn.fetchrow(f"SELECT {TASK_COLUMNS}, {ATTEMPTS}, {RESULTS} FROM tasks t WHERE id = $1",
                                      task_id)
        if row is None:
            raise TaskNotFound(task_id)
        return replace(_task(row, attempts=_attempts(row[19])), results=tuple(_result(r) for r in row[20]))

    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                         cursor: str | None = None) -> Page:
        where, args = ["true"], []
        for column, value in (("state", state), ("type", type), ("cursor", cursor)):
            if value is not None:
                args.append(str(value))
                where.append(f"id < ${len(args)}" if column == "cursor" else f"{column} = ${len(args)}")
        async with self._conn() as conn:
            rows = await conn.fetch(f"SELECT {TASK_COLUMNS}, {ATTEMPTS} FROM tasks t WHERE {' AND '.join(where)} "
                                    f"ORDER BY id DESC LIMIT ${len(args) + 1}", *args, limit + 1)
        tasks = [_task(r, attempts=_attempts(r[19])) for r in rows[:limit]]
        return Page(tasks, tasks[-1].id if len(rows) > limit else None)

    async def counts(self) -> dict[State, int]:
        async with self._conn() as conn:
            rows = await conn.fetch("SELECT state, count(*) FROM tasks WHERE state IN "
                                    "('pending', 'leased', 'running', 'retry_wait', 'cancelling') GROUP BY state")
        return {State(r[0]): r[1] for r in rows}

    async def request_cancel(self, task_id: str, *, now: float) -> State:
        async with self._conn() as conn, conn.transaction():
            current = await conn.fetchval("SELECT state FROM tasks WHERE id = $1 FOR NO KEY UPDATE", task_id)
            if current is None:
                raise TaskNotFound(task_id)
            target = cancel_step(State(current))
            if target.value == current:
                return target
            if target is State.CANCELLED:
                await conn.execute("UPDATE tasks SET state = $1, phase = NULL, finished_at = $2, updated_at = $2 "
                                   "WHERE id = $3", target.value, now, task_id)
            else:
                await conn.execute("UPDATE tasks SET state = $1, cancel_requested_at = $2, updated_at = $2 "
                                   "WHERE id = $3", target.value, now, task_id)
            return target

    async def retry(self, task_id: str, *, now: float) -> Task:
        async with self._conn() as conn, conn.transaction():
            current = await conn.fetchval("SELECT state FROM tasks WHERE id = $1 FOR NO KEY UPDATE", task_id)
            if current is None:
                raise TaskNotFound(task_id)
            target = retry_step(State(current))
            # A new budget: attempt counts from zero again; attempts[].number keeps counting every row.
            row = await conn.fetchrow(
                "UPDATE tasks SET state = $1, attempt = 0, interruptions = 0, available_at = $2, updated_at = $2, "
                f"finished_at = NULL, error = NULL WHERE id = $3 RETURNING {TASK_COLUMNS}", target.value, now, task_id)
        return _task(row)

    # workers

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        if limit <= 0:
            return []
        group = self._claims.get(where)
        if group is None:
            group = self._claims[where] = _Group(lambda calls: self._claim_group(where, calls))
        return await group(_ClaimCall(worker, limit, now, lease_s))

    async def _claim_group(self, where: ClaimFilter, calls: list[_ClaimCall]) -> list[list[Claimed]]:
        """One statement leases the tasks of every queued claim of this filter, split in queue order."""
        slots = [(call, new_id(call.now), new_token()) for call in calls for _ in range(call.limit)]
        sql, extra = _claim_sql(where)
        async with self._conn() as conn:
            rows = await conn.fetch(
                sql, min(c.now for c in calls), len(slots), [s[1] for s in slots], [s[2] for s in slots],
                [s[0].worker.node_id for s in slots], [s[0].worker.instance_id for s in slots],
                [s[0].worker.worker_id for s in slots], [s[0].now for s in slots],
                [s[0].now + s[0].lease_s for s in slots], *extra)
        claimed: dict[int, list[Claimed]] = {id(c): [] for c in calls}
        for row in rows:  # ordered by slot, so each claim gets a run of the queue's head
            call, attempt_id, token = slots[row[0] - 1]
            task = _task(row[1:])
            claimed[id(call)].append(Claimed(task, Lease(task.id, attempt_id, token, call.now + call.lease_s)))
        return [claimed[id(c)] for c in calls]

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        if not leases:
            return {}
        arrays = _lease_arrays(leases)
        async with self._conn() as conn:
            renewed = await conn.fetch(
                f"WITH l AS (SELECT * FROM {LEASES.format(types='', names='')}), "
                f"locked AS MATERIALIZED ({FENCED.format(cols='', now='$4')}) "
                "UPDATE tasks t SET lease_expires_at = $5 FROM locked WHERE t.id = locked.id "
                "RETURNING t.lease_attempt_id", *arrays, now, now + lease_s)
            return await _lost(conn, leases, {r[0] for r in renewed})

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        if not notes:
            return {}
        last = list({n.lease.attempt_id: n for n in notes}.values())  # one row per lease, the latest note
        leases = [n.lease for n in last]
        async with self._conn() as conn:
            noted = await conn.fetch(
                f"WITH l AS (SELECT * FROM {LEASES.format(types=', $4::text[], $5::text[]', names=', phase, progress')}), "
                f"locked AS MATERIALIZED ({FENCED.format(cols=', l.phase, l.progress', now='$6')}), "
                "noted AS (UPDATE tasks t SET phase = locked.phase, progress = coalesce(locked.progress, t.progress), "
                "updated_at = $6, state = 'running' FROM locked WHERE t.id = locked.id RETURNING t.lease_attempt_id), "
                "started AS (UPDATE attempts a SET status = 'running' FROM noted "
                "WHERE a.id = noted.lease_attempt_id AND a.status = 'leased') "
                "SELECT lease_attempt_id FROM noted",
                *_lease_arrays(leases), [n.phase.value for n in last],
                [None if n.progress is None else json.dumps(n.progress) for n in last], now)
            return await _lost(conn, leases, {r[0] for r in noted})

    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float) -> ResultBatch:
        async with self._conn() as conn:
            # FOR SHARE holds off an expiry or cancel until the result is in (or sees it first).
            fenced, stored = await conn.fetchrow(
                f"WITH fenced AS (SELECT id FROM tasks WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3 "
                f"AND {LIVE} AND lease_expires_at > $4 FOR SHARE), "
                "stored AS (INSERT INTO results (idempotency_key, task_id, attempt_id, plugin, sequence, sha256, "
                "final, payload, created_at) SELECT $5, id, $2, $6, $7, $8, $9, $10, $4 FROM fenced "
                "ON CONFLICT (idempotency_key) DO NOTHING RETURNING 1) "
                "SELECT (SELECT count(*) FROM fenced), (SELECT count(*) FROM stored)",
                lease.task_id, lease.attempt_id, lease.token, now, batch.idempotency_key, batch.plugin,
                batch.sequence, batch.sha256, batch.final, json.dumps(batch.payload))
            if not fenced:
                raise await _why_lost(conn, lease)
            if stored:
                return batch
            earlier = await conn.fetchrow("SELECT plugin, sequence, idempotency_key, sha256, final, payload "
                                          "FROM results WHERE idempotency_key = $1", batch.idempotency_key)
        if earlier[3] != batch.sha256:
            raise Conflict(f"result key {batch.idempotency_key} was stored with another sha256")
        return _result(earlier)

    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        plain_success = outcome.status is AttemptStatus.SUCCEEDED and outcome.exit_status is None \
            and outcome.stderr_tail is None
        if plain_success and await self._completions((lease, now)):
            return State.COMPLETED
        async with self._conn() as conn, conn.transaction():
            row = await conn.fetchrow(
                "SELECT state, attempt, max_attempts, interruptions, lease_expires_at FROM tasks "
                "WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3 FOR NO KEY UPDATE",
                lease.task_id, lease.attempt_id, lease.token)
            if row is None or not _may_end(State(row[0]), row[4], now):
                raise await _why_lost(conn, lease)
            end = decide_end(State(row[0]), outcome, attempt=row[1], max_attempts=row[2], interruptions=row[3],
                             policy=policy, now=now)
            await _write_ends(conn, [(lease, outcome, end)], now)
        return end.state

    async def _complete_group(self, calls: list[tuple[Lease, float]]) -> list[bool]:
        """Successful attempts of many workers, fenced and completed in one statement; False: take the slow path."""
        leases = [lease for lease, _ in calls]
        async with self._conn() as conn:
            done = await conn.fetch(
                f"WITH l AS (SELECT * FROM {LEASES.format(types=', $4::float8[]', names=', now')}), "
                f"locked AS MATERIALIZED ({FENCED.format(cols=', l.now', now='l.now')}), "
                "done AS (UPDATE tasks t SET state = 'completed', phase = NULL, error = NULL, updated_at = locked.now, "
                "finished_at = locked.now, lease_token = NULL FROM locked WHERE t.id = locked.id "
                "RETURNING t.lease_attempt_id, locked.now), "
                "succeeded AS (UPDATE attempts a SET status = 'succeeded', finished_at = done.now FROM done "
                "WHERE a.id = done.lease_attempt_id) "
                "SELECT lease_attempt_id FROM done", *_lease_arrays(leases), [now for _, now in calls])
        completed = {r[0] for r in done}
        return [lease.attempt_id in completed for lease in leases]

    # the reconciler: each pass takes only rows no other node holds (SKIP LOCKED), in bounded steps

    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None) -> list[Expired]:
        args: list[Any]
        if node_id is None:
            where, args = "lease_expires_at <= $1", [now]
        else:
            where, args = "node_id = $1 AND lease_instance IS DISTINCT FROM $2", [node_id, keep_instance]
        error = TaskError("lease_expired", "the lease expired before the worker renewed it")
        outcome = Outcome(AttemptStatus.EXPIRED, error)
        expired: list[Expired] = []
        while True:
            async with self._conn() as conn, conn.transaction():
                rows = await conn.fetch(
                    "SELECT state, attempt, max_attempts, interruptions, id, lease_attempt_id, lease_token "
                    f"FROM tasks WHERE state IN ('leased', 'running', 'cancelling') AND {where} "
                    f"ORDER BY id LIMIT {SWEEP} FOR NO KEY UPDATE SKIP LOCKED", *args)
                ends = [(Lease(r[4], r[5], r[6], now), outcome,
                         decide_end(State(r[0]), outcome, attempt=r[1], max_attempts=r[2], interruptions=r[3],
                                    policy=policy, now=now)) for r in rows]
                if ends:
                    await _write_ends(conn, ends, now)
            expired.extend(Expired(lease.task_id, lease.attempt_id, end.state) for lease, _, end in ends)
            if len(rows) < SWEEP:
                return expired

    async def promote_due(self, *, now: float) -> int:
        async with self._conn() as conn:
            rows = await conn.fetch(
                "WITH due AS (SELECT id FROM tasks WHERE state = 'retry_wait' AND available_at <= $1 "
                "FOR NO KEY UPDATE SKIP LOCKED) "
                "UPDATE tasks t SET state = $2, updated_at = $1 FROM due WHERE t.id = due.id RETURNING t.id",
                now, step(State.RETRY_WAIT, Event.PROMOTE).value)
        return len(rows)

    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[str]:
        error = json.dumps(TaskError("cancel_deadline", f"the worker did not stop within {deadline_s}s").to_json())
        done: list[str] = []
        while True:
            async with self._conn() as conn:
                rows = await conn.fetch(
                    "WITH due AS (SELECT id, lease_attempt_id FROM tasks WHERE state = 'cancelling' "
                    f"AND cancel_requested_at <= $1 ORDER BY id LIMIT {SWEEP} FOR NO KEY UPDATE SKIP LOCKED), "
                    "ended AS (UPDATE attempts a SET status = 'cancelled', finished_at = $2, error = $3 "
                    "FROM due WHERE a.id = due.lease_attempt_id) "
                    "UPDATE tasks t SET state = $4, phase = NULL, finished_at = $2, updated_at = $2, "
                    "lease_token = NULL FROM due WHERE t.id = due.id RETURNING t.id",
                    now - deadline_s, now, error, step(State.CANCELLING, Event.CANCEL_ACK).value)
            done.extend(r[0] for r in rows)
            if len(rows) < SWEEP:
                return done

    async def prune(self, *, before: float) -> int:
        pruned = 0
        while True:
            async with self._conn() as conn:
                n = await conn.fetchval(
                    f"WITH old AS (SELECT id FROM tasks WHERE finished_at < $1 AND {TERMINAL_SQL} "
                    f"LIMIT {SWEEP} FOR UPDATE SKIP LOCKED), "
                    "r AS (DELETE FROM results WHERE task_id IN (SELECT id FROM old)), "
                    "a AS (DELETE FROM attempts WHERE task_id IN (SELECT id FROM old)), "
                    "t AS (DELETE FROM tasks WHERE id IN (SELECT id FROM old) RETURNING 1) "
                    "SELECT count(*) FROM t", before)
            pruned += int(n)
            if n < SWEEP:
                return pruned


# grouping many callers' writes into one statement


@dataclass(frozen=True, slots=True, eq=False)
class _ClaimCall:
    worker: Worker
    limit: int
    now: float
    lease_s: float


class _Group(Generic[I, R]):
    """Group commit: calls that queue up while one statement is in flight go out together in the next.

    A short-lived flusher task, owned here and awaited by drain(), runs the statements, so a caller
    cancelled mid-write cannot abort the write of the others. Each caller gets its own result; when
    the statement fails, each gets its own StoreUnavailable.
    """

    def __init__(self, run: Callable[[list[I]], Awaitable[list[R]]]) -> None:
        self._run = run
        self._queue: deque[tuple[I, asyncio.Future[R]]] = deque()
        self._flusher: asyncio.Task[None] | None = None

    async def __call__(self, item: I) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._queue.append((item, future))
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush(), name="tidepool-postgres-group")
        return await future

    async def drain(self) -> None:
        """Wait for the writes already queued."""
        if self._flusher is not None:
            await asyncio.wait([self._flusher])

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch: list[tuple[I, asyncio.Future[R]]] = []
                while self._queue and len(batch) < MAX_GROUP:
                    item, future = self._queue.popleft()
                    if not future.done():  # skip callers cancelled while they waited
                        batch.append((item, future))
                if batch:
                    await self._run_batch(batch)
        finally:
            self._flusher = None
            while self._queue:  # only if the flusher itself was cancelled (loop shutdown)
                _, future = self._queue.popleft()
                if not future.done():
                    future.set_exception(StoreUnavailable("the store closed before this write was sent"))

    async def _run_batch(self, batch: list[tuple[I, asyncio.Future[R]]]) -> None:
        try:
            results = await self._run([item for item, _ in batch])
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    error = StoreUnavailable(f"grouped write failed: {exc}")
                    error.__cause__ = exc.__cause__ if isinstance(exc, StoreUnavailable) else exc
                    future.set_exception(error)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


# SQL helpers, each run on a connection the caller holds


async def _schema_version(conn: Conn, schema: str) -> int:
    if await conn.fetchval("SELECT to_regclass($1)", f'"{schema}".schema_version') is None:
        return 0
    version = await conn.fetchval(f'SELECT max(version) FROM "{schema}".schema_version')
    return int(version or 0)


async def _existing(conn: Conn, new: NewTask) -> Task | None:
    if not new.idempotency_key:
        return None
    row = await conn.fetchrow(f"SELECT {TASK_COLUMNS}, fingerprint FROM tasks WHERE idempotency_key = $1",
                              new.idempotency_key)
    if row is None:
        return None
    if row[-1] != new.fingerprint():
        raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another body")
    return _task(row)


async def _check_room(conn: Conn, n: int, max_queued: int) -> None:
    # Submits that check the limit take turns, so two nodes cannot both fill the last places.
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('tidepool.queued.' || current_schema(), 0))")
    queued = await conn.fetchval("SELECT count(*) FROM (SELECT 1 FROM tasks WHERE state IN ('pending', 'retry_wait') "
                                 "LIMIT $1) q", max_queued + 1)
    if queued + n > max_queued:
        raise QueueFull(f"{queued} tasks are queued; pool.max_queued is {max_queued}")


async def _insert(conn: Conn, new: NewTask, now: float) -> tuple[Task, bool]:
    """Insert, or find the task that already has this idempotency key (possibly just committed by another)."""
    row = await conn.fetchrow(
        "INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags, "
        "idempotency_key, fingerprint, created_at, updated_at, available_at) "
        "VALUES ($1, $2, $3, $4, 'pending', $5, $6, $7, $8, $9, $10, $10, $11) "
        f"ON CONFLICT (idempotency_key) DO NOTHING RETURNING {TASK_COLUMNS}",
        new_id(now), new.type, json.dumps(new.payload), new.priority, new.max_attempts, new.timeout_s,
        sorted(new.required_tags), new.idempotency_key, new.fingerprint(), now,
        new.available_at if new.available_at is not None else now)
    if row is not None:
        return _task(row), True
    existing = await _existing(conn, new)
    if existing is None:  # the other task was pruned in between: rare enough to report, not to loop on
        raise StoreUnavailable(f"idempotency_key {new.idempotency_key!r} changed hands during the submit; retry")
    return existing, False


def _claim_sql(where: ClaimFilter) -> tuple[str, list[Any]]:
    """The claim statement for a filter and its extra arguments ($10 on)."""
    clauses: list[str] = []
    extra: list[Any] = []
    if "*" not in where.type_globs:
        extra.append([_glob_regex(g) for g in where.type_globs])
        clauses.append(f"AND type ~ ANY(${9 + len(extra)}::text[])")
    tags = "cardinality(required_tags) = 0"
    if where.tag_sets:
        extra.append(json.dumps([sorted(s) for s in where.tag_sets]))
        tags += (f" OR EXISTS (SELECT 1 FROM jsonb_array_elements(${9 + len(extra)}::jsonb) AS s(tags) "
                 "WHERE required_tags <@ ARRAY(SELECT jsonb_array_elements_text(s.tags)))")
    sql = (
        "WITH picked AS (SELECT id, priority, created_at FROM tasks "
        "WHERE state IN ('pending', 'retry_wait') AND available_at <= $1 AND attempt < max_attempts "
        f"{' '.join(clauses)} AND ({tags}) "
        "ORDER BY priority DESC, created_at, id LIMIT $2 FOR NO KEY UPDATE SKIP LOCKED), "
        "numbered AS (SELECT id, row_number() OVER (ORDER BY priority DESC, created_at, id) AS n FROM picked), "
        "slots AS (SELECT * FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::float8[], "
        "$9::float8[]) WITH ORDINALITY AS s(attempt_id, token, node_id, instance_id, worker_id, now, expires_at, n)), "
        "leased AS (UPDATE tasks t SET state = 'leased', attempt = t.attempt + 1, attempt_rows = t.attempt_rows + 1, "
        "node_id = s.node_id, phase = NULL, progress = NULL, error = NULL, updated_at = s.now, lease_attempt_id = s.attempt_id, "
        "lease_token = s.token, lease_expires_at = s.expires_at, lease_instance = s.instance_id "
        "FROM numbered p JOIN slots s USING (n) WHERE t.id = p.id "
        "RETURNING s.n, s.worker_id, t.attempt_rows, t.lease_attempt_id, t.lease_instance, "
        f"{', '.join('t.' + c for c in TASK_COLUMNS.split(', '))}), "
        "started AS (INSERT INTO attempts (id, task_id, number, node_id, instance_id, worker_id, status, started_at) "
        "SELECT lease_attempt_id, id, attempt_rows, node_id, lease_instance, worker_id, 'leased', updated_at "
        "FROM leased) "
        f"SELECT n, {TASK_COLUMNS} FROM leased ORDER BY n")
    return sql, extra


def _glob_regex(glob: str) -> str:
    """An anchored PostgreSQL regex matching what fnmatch.fnmatchcase(name, glob) matches."""
    out, i, n = ["^"], 0, len(glob)
    while i < n:
        c, i = glob[i], i + 1
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[" and (j := _class_end(glob, i)) is not None:
            out.append(_char_class(glob[i:j]))
            i = j + 1
        else:
            out.append(_literal(c))
    return "".join(out) + "$"


def _class_end(glob: str, i: int) -> int | None:
    """Index of the `]` closing a class that opened before i, as fnmatch finds it; None: a literal `[`."""
    j = i + 1 if i < len(glob) and glob[i] == "!" else i
    j = j + 1 if j < len(glob) and glob[j] == "]" else j
    j = glob.find("]", j)
    return None if j < 0 else j


def _char_class(body: str) -> str:
    negate = body.startswith("!")
    body = body[1:] if negate else body
    items, k = [], 0
    while k < len(body):
        if k + 2 < len(body) and body[k + 1] == "-":
            if body[k] <= body[k + 2]:  # fnmatch drops reversed ranges
                items.append(f"{_literal(body[k])}-{_literal(body[k + 2])}")
            k += 3
        else:
            items.append(_literal(body[k]))
            k += 1
    if not items:
        return "." if negate else "[^\\x00-\\U0010FFFF]"  # [!] is any character, [] with no range none
    return f"[{'^' if negate else ''}{''.join(items)}]"


def _literal(c: str) -> str:
    # In PostgreSQL's regexes a backslash before a non-alphanumeric character makes it literal.
    return c if c.isalnum() or not c.isascii() else "\\" + c


def _lease_arrays(leases: Sequence[Lease]) -> tuple[list[str], list[str], list[str]]:
    return [x.task_id for x in leases], [x.attempt_id for x in leases], [x.token for x in leases]


async def _lost(conn: Conn, leases: Sequence[Lease], kept: set[str]) -> dict[str, LeaseLost]:
    """The leases a multi-row write did not take, each with why (a fresh read: a cancel may have won)."""
    missed = [lease for lease in leases if lease.attempt_id not in kept]
    if not missed:
        return {}
    rows = await conn.fetch(f"SELECT l.attempt_id FROM {LEASES.format(types='', names='')} JOIN tasks t ON t.id = l.id "
                            "AND t.lease_attempt_id = l.attempt_id AND t.lease_token = l.token "
                            "WHERE t.state = 'cancelling'", *_lease_arrays(missed))
    cancelling = {r[0] for r in rows}
    return {x.attempt_id: TaskCancelling(x.task_id, x.attempt_id) if x.attempt_id in cancelling
            else LeaseLost(x.task_id, x.attempt_id) for x in missed}


async def _why_lost(conn: Conn, lease: Lease) -> LeaseLost:
    state = await conn.fetchval("SELECT state FROM tasks WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3",
                                lease.task_id, lease.attempt_id, lease.token)
    if state == State.CANCELLING:
        return TaskCancelling(lease.task_id, lease.attempt_id)
    return LeaseLost(lease.task_id, lease.attempt_id)


def _may_end(state: State, lease_expires_at: float, now: float) -> bool:
    """A worker may end its attempt while its lease is live, and always acknowledge a cancel."""
    return state is State.CANCELLING or (state.active and lease_expires_at > now)


async def _write_ends(conn: Conn, ends: list[tuple[Lease, Outcome, Ending]], now: float) -> None:
    """Write how attempts ended, all in one statement; their task rows are locked by the caller."""
    errors = [None if e.error is None else json.dumps(e.error.to_json()) for _, _, e in ends]
    await conn.execute(
        "WITH e AS (SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int[], "
        "$7::float8[], $8::float8[], $9::int[], $10::text[]) AS e(task_id, attempt_id, state, status, error, uncount, "
        "available_at, finished_at, exit_status, stderr_tail)), "
        "ended AS (UPDATE attempts a SET status = e.status, finished_at = $11, error = e.error, "
        "exit_status = e.exit_status, stderr_tail = e.stderr_tail FROM e WHERE a.id = e.attempt_id) "
        "UPDATE tasks t SET state = e.state, phase = NULL, error = e.error, updated_at = $11, "
        "attempt = t.attempt - e.uncount, interruptions = t.interruptions + e.uncount, "
        "available_at = coalesce(e.available_at, t.available_at), finished_at = e.finished_at, lease_token = NULL "
        "FROM e WHERE t.id = e.task_id",
        [lease.task_id for lease, _, _ in ends], [lease.attempt_id for lease, _, _ in ends],
        [e.state.value for _, _, e in ends], [e.attempt_status.value for _, _, e in ends], errors,
        [1 if e.uncount_attempt else 0 for _, _, e in ends], [e.available_at for _, _, e in ends],
        [None if e.available_at is not None else now for _, _, e in ends],
        [o.exit_status for _, o, _ in ends], [o.stderr_tail for _, o, _ in ends], now)


# rows to domain objects


def _task(row: Any, *, attempts: tuple[Attempt, ...] = ()) -> Task:
    """A Task from a row that starts with TASK_COLUMNS."""
    return Task(
        id=row[0], type=row[1], payload=_loads(row[2]), priority=row[3], state=State(row[4]),
        phase=None if row[5] is None else Phase(row[5]), progress=None if row[6] is None else json.loads(row[6]),
        attempt=row[7], max_attempts=row[8], interruptions=row[9], timeout_s=row[10],
        required_tags=tuple(row[11]), idempotency_key=row[12], node_id=row[13],
        error=None if row[14] is None else _error(row[14]), created_at=row[15], updated_at=row[16],
        available_at=row[17], finished_at=row[18], attempts=attempts,
    )


def _loads(text: str) -> Any:
    # Most payloads of a busy queue are empty; skip the parser for them.
    return {} if text == "{}" else json.loads(text)


def _error(text: str) -> TaskError:
    data = json.loads(text)
    return TaskError(data["code"], data["message"])


def _attempts(rows: Sequence[Any]) -> tuple[Attempt, ...]:
    return tuple(Attempt(r[0], r[1], r[2], r[3], r[4], AttemptStatus(r[5]), r[6], r[7],
                         None if r[8] is None else _error(r[8]), r[9], r[10]) for r in rows)


def _result(row: Any) -> ResultBatch:
    return ResultBatch(row[0], row[1], row[2], row[3], bool(row[4]), json.loads(row[5]))
