"""The embedded SQLite store: WAL with synchronous=FULL, one writer thread that group-commits.

Every write is an op queued to one thread that owns the only writing connection. The thread takes
whatever ops have queued up and runs them in one transaction, so many workers share each fsync
(PITFALLS: ~4k single-step transactions/s here, ~45k steps/s grouped). Each plain op runs inside
its own savepoint, so an op that raises (LeaseLost, Conflict, or a SQLite error) fails alone and the
others of its transaction stand; claims and completions of a batch are gathered into shared
statements. Only a failing transaction as a whole fails every op with StoreUnavailable. Reads use
a second connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import queue
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import anyio
import anyio.to_thread
import psutil  # type: ignore[import-untyped]
from anyio.abc import TaskStatus

from .. import schedules
from ..errors import (
    ConfigError,
    Conflict,
    LeaseLost,
    ScheduleNotFound,
    SchemaMismatch,
    StoreUnavailable,
    TaskCancelling,
    TaskNotFound,
    TidepoolError,
)
from ..lifecycle import Event, RetryPolicy, decide_end, step
from ..model import (
    CANCELLED_ON_REQUEST,
    Attempt,
    Claimed,
    ClaimFilter,
    Lease,
    NewTask,
    Outcome,
    ResultBatch,
    State,
    Task,
    TaskError,
    Worker,
    cancel_deadline_error,
    new_id,
    new_token,
)
from ..schedules import Fired, Schedule
from .port import CancelAnswer, Ended, Ending, Expired, Node, Page, PhaseNote
from .rows import (
    ATTEMPT_COLUMNS,
    NODE_COLUMNS,
    RESULT_COLUMNS,
    SCHEDULE_COLUMNS,
    SCHEMA_VERSION,
    TASK_COLUMNS,
    attempt_of,
    loads,
    node_of,
    node_values,
    result_of,
    schedule_of,
    schedule_values,
    task_of,
)
from .rules import (
    QUEUED_SQL,
    TERMINAL_SQL,
    UNFINISHED_SQL,
    WORKING_SQL,
    batch_answer,
    cancel_step,
    check_room,
    completable_at_once,
    expiry_outcome,
    may_end,
    progress_text,
    retry_step,
)

T = TypeVar("T")
log = logging.getLogger("tidepool.store.sqlite")
LEASE_CHUNK = 500  # rows per leasing statement: 7 parameters each, far below SQLite's 32,766
WRITE_FAILURE_HOLD_S = 30.0  # a failed write transaction makes the node unready this long (see write_failure)
GROUP_PAUSE_S = 0.0005  # under load, how long the writer waits for more ops to share a transaction
GROUP_PAUSE_FROM = 8  # ops in this batch and the last before a pause can pay for itself (see _write_loop)
NODES = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    instance_id TEXT NOT NULL,
    hostname TEXT NOT NULL,
    pid INTEGER NOT NULL,
    version TEXT NOT NULL,
    started_at REAL NOT NULL,
    heartbeat_at REAL NOT NULL,
    heartbeat_s REAL NOT NULL,
    stopped_at REAL,
    task_types TEXT NOT NULL,
    tags TEXT NOT NULL,
    max_workers INTEGER NOT NULL
);
"""
SCHEDULES = """
CREATE TABLE IF NOT EXISTS schedules (
    name TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    paused INTEGER NOT NULL DEFAULT 0,
    next_tick_at REAL,
    next_run_at REAL,
    last_run_at REAL,
    last_task_id TEXT
);
CREATE INDEX IF NOT EXISTS schedules_due ON schedules (next_run_at) WHERE paused = 0;
"""
SCHEMA = """
CREATE TABLE tasks (
    id TEXT PRIMARY KEY,
    type TEXT NOT NULL,
    payload TEXT NOT NULL,
    priority INTEGER NOT NULL,
    state TEXT NOT NULL,
    phase TEXT,
    progress TEXT,
    attempt INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    interruptions INTEGER NOT NULL DEFAULT 0,
    timeout_s REAL,
    required_tags TEXT NOT NULL,
    idempotency_key TEXT UNIQUE,
    fingerprint TEXT NOT NULL,
    node_id TEXT,
    error TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    available_at REAL NOT NULL,
    finished_at REAL,
    lease_attempt_id TEXT,
    lease_token TEXT,
    lease_expires_at REAL,
    lease_instance TEXT,
    cancel_requested_at REAL
);
CREATE INDEX tasks_queue ON tasks (priority DESC, created_at, id) WHERE state IN ('pending', 'retry_wait');
CREATE INDEX tasks_leases ON tasks (lease_expires_at) WHERE state IN ('leased', 'running', 'cancelling');
CREATE INDEX tasks_state ON tasks (state, id);
CREATE INDEX tasks_type ON tasks (type, id);
CREATE INDEX tasks_finished ON tasks (finished_at) WHERE finished_at IS NOT NULL;
CREATE TABLE attempts (
    id TEXT PRIMARY KEY,
    task_id TEXT NOT NULL,
    number INTEGER NOT NULL,
    node_id TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    status TEXT NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL,
    error TEXT,
    exit_status INTEGER,
    stderr_tail TEXT
);
CREATE INDEX attempts_task ON attempts (task_id, number);
CREATE TABLE results (
    idempotency_key TEXT PRIMARY KEY,
    task_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    plugin TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    final INTEGER NOT NULL,
    payload TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX results_task ON results (task_id, created_at);
"""

FENCE = "id = ? AND lease_attempt_id = ? AND lease_token = ?"
Op: TypeAlias = "Callable[[sqlite3.Connection, _Batch], Any] | _Grouped"


@dataclass
class _Batch:
    """Facts shared by the ops of one transaction."""

    queued: int | None = None

    def queued_count(self, conn: sqlite3.Connection) -> int:
        if self.queued is None:
            row = conn.execute(f"SELECT count(*) FROM tasks WHERE state IN {QUEUED_SQL}").fetchone()
            self.queued = int(row[0])
        return self.queued


class SqliteStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._ops: queue.SimpleQueue[tuple[Op, asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._reader: sqlite3.Connection | None = None
        self._read_limiter = anyio.CapacityLimiter(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._inode: tuple[int, int] | None = None  # (device, inode) of the file opened: see _still_ours
        self._wal_inode: tuple[int, int] | None = None  # and of its write-ahead log, once it exists
        self._write_failure: tuple[str, float] | None = None  # why a write transaction failed, and when
        self._corrupt: str | None = None  # once SQLite says the file is malformed, for good

    # lifecycle of the adapter

    async def open(self, *, migrate: bool = True) -> int:
        self._loop = asyncio.get_running_loop()
        writer, found = await anyio.to_thread.run_sync(self._connect, migrate)
        self._reader = await anyio.to_thread.run_sync(self._connect_reader)
        self._writer = threading.Thread(target=self._write_loop, args=(writer,), name="tidepool-sqlite-writer",
                                        daemon=True)
        self._writer.start()
        return found

    async def close(self) -> None:
        if self._writer is not None:
            self._closing = True  # from here on writes are refused rather than queued behind the end
            self._ops.put(None)
            await anyio.to_thread.run_sync(self._writer.join)
            self._writer = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _connect(self, migrate: bool) -> tuple[sqlite3.Connection, int]:
        """The writer's connection, the schema brought to SCHEMA_VERSION (when `migrate`), and the version it had."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            try:  # before anything is written, the journal mode included
                version = self._check_ours(conn)
                if version > SCHEMA_VERSION or (version < SCHEMA_VERSION and not migrate):
                    raise SchemaMismatch(f"store {self.path} has schema version {version}, " + (
                        f"newer than this tidepool understands ({SCHEMA_VERSION}): upgrade tidepool"
                        if version > SCHEMA_VERSION else f"needs {SCHEMA_VERSION}: run `tidepool migrate`"))
            except (ConfigError, SchemaMismatch):
                conn.close()
                raise
            stat = os.stat(self.path)
            self._inode = (stat.st_dev, stat.st_ino)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")  # an acknowledged commit survives power loss
            conn.execute("PRAGMA busy_timeout=5000")
            if version < SCHEMA_VERSION:  # each step upgrades one version; all in one transaction
                steps = [SCHEMA, SCHEDULES, NODES][version:]
                conn.executescript(f"BEGIN; {' '.join(steps)}; PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
            return conn, version
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"store {self.path}: {exc}") from exc

    def _check_ours(self, conn: sqlite3.Connection) -> int:
        """Before anything is written: the file is tidepool's (or empty), and the one name of its database.
        SQLite keeps the write-ahead log beside each name: a process writing through a second name writes
        a log of its own into the same file, and neither the lock file nor the node's row (written to the
        other log) can see it. So a second name is refused, even one a backup tool made."""
        links = os.stat(self.path).st_nlink
        if links > 1:
            raise ConfigError(f"config: store.url: {self.path} has {links} hard links; SQLite ties its write-ahead "
                              "log to a file's name, so two names of one database corrupt it: remove the other "
                              "links (back it up with `sqlite3 FILE .backup` instead)")
        version: int = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        if (version == 0 and tables) or (version > 0 and "tasks" not in tables):  # a version, but not ours
            held = f"it holds tables {', '.join(tables[:5])}{', ...' if len(tables) > 5 else ''}" if tables else \
                f"it has schema version {version} and no tasks table"
            raise ConfigError(f"config: store.url: {self.path} is not a tidepool database ({held}): give tidepool a "
                              "file of its own")
        return version

    def _still_ours(self) -> None:
        """The file opened, and its write-ahead log, are still the database's names. Deleted or replaced while
        open, SQLite would go on writing to a file no name reaches: every task acknowledged from then on would
        be gone at restart (the log holds every commit since the last checkpoint)."""
        wal = self.path.with_name(self.path.name + "-wal")
        for name, opened in ((self.path, self._inode), (wal, self._wal_inode)):
            if opened is None:
                continue
            try:
                stat = os.stat(name)
                same = (stat.st_dev, stat.st_ino) == opened
            except FileNotFoundError:
                same = False
            if not same:
                raise StoreUnavailable(f"the database file {name} was deleted or replaced while open; nothing more "
                                       "is written: restart the node (what it held since is lost with the file)")
        if self._wal_inode is None:
            with contextlib.suppress(FileNotFoundError):  # made by the first write; kept while we are open
                stat = os.stat(wal)
                self._wal_inode = (stat.st_dev, stat.st_ino)

    async def write_failure(self) -> str | None:
        """Why writes fail (the file is corrupt or gone, or a write transaction failed in the last
        WRITE_FAILURE_HOLD_S), else None. A write that gets through does not clear it: on a full disk a
        heartbeat's update in place commits while every insert fails."""
        if self._corrupt:
            return self._corrupt
        if self._write_failure is not None and time.monotonic() - self._write_failure[1] < WRITE_FAILURE_HOLD_S:
            return self._write_failure[0]
        return None

    def _connect_reader(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout=5000")
        return conn

    # the writer thread

    async def _write(self, op: Op) -> Any:
        if self._writer is None or self._loop is None or self._closing:
            raise StoreUnavailable("the store is not open")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._ops.put((op, future))
        return await future

    def _write_loop(self, conn: sqlite3.Connection) -> None:
        try:
            closing, last_batch = False, 0
            while not closing:
                queued = [self._ops.get()]
                closing = self._take_queued(queued)
                if len(queued) >= GROUP_PAUSE_FROM and last_batch >= GROUP_PAUSE_FROM and not closing:
                    # Busy: ops keep arriving while we work. A short pause (the GIL goes to the event loop)
                    # lets more of them share this transaction and its fsync. A store not under sustained
                    # load commits at once: a lone submit, or a worker's outcome with its next claim,
                    # should not wait for company that is not coming (measured: pickup p50 +0.3 ms). Nor
                    # should a pool of a few workers, whose batches hold a claim or two and an outcome
                    # write: pausing from 2 ops on cost 2 workers a third and 4 workers half of their
                    # no-op drain rate; from 8 on, 8-, 16- and 32-worker drains measured the same (within
                    # this machine's noise).
                    time.sleep(GROUP_PAUSE_S)
                    closing = self._take_queued(queued)
                ops = [op for op in queued if op is not None]
                last_batch = len(ops)
                if ops:
                    outcomes = self._run_batch(conn, ops)
                    assert self._loop is not None
                    self._loop.call_soon_threadsafe(_settle, outcomes)
        finally:
            conn.close()
            leftover: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = [
                (item[1], None, StoreUnavailable("the store closed")) for item in _drain(self._ops) if item is not None]
            if leftover and self._loop is not None:
                self._loop.call_soon_threadsafe(_settle, leftover)

    def _take_queued(self, queued: list[tuple[Op, asyncio.Future[Any]] | None]) -> bool:
        """Append every op queued so far; True once the close sentinel (None) is among them."""
        while True:
            try:
                queued.append(self._ops.get_nowait())
            except queue.Empty:
                return None in queued

    def _run_batch(self, conn: sqlite3.Connection, ops: list[tuple[Op, asyncio.Future[Any]]]) -> list[Any]:
        batch = _Batch()
        outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        try:
            if self._corrupt:
                raise StoreUnavailable(self._corrupt)
            self._still_ours()
            conn.execute("BEGIN IMMEDIATE")
            for group in _groups(ops):
                op = group[0][0]
                if isinstance(op, _Grouped):
                    results = op.run_group(conn, batch, [o for o, _ in group])
                    outcomes.extend((future, *r) for (_, future), r in zip(group, results, strict=True))
                    continue
                outcomes.append((group[0][1], *_run_alone(conn, batch, op)))
            conn.execute("COMMIT")
        except Exception as exc:  # the whole transaction is gone: tell every op
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            self._note_corrupt(exc)
            if isinstance(exc, StoreUnavailable):  # the file is gone or corrupt: said as it is
                error = exc
            else:
                error = StoreUnavailable(f"sqlite write to {self.path} failed: {exc}")
                error.__cause__ = exc
            self._write_failure = (str(error), time.monotonic())
            return [(future, None, error) for _, future in ops]
        return outcomes

    def _note_corrupt(self, exc: BaseException) -> None:
        if self._corrupt is None and _error_code(exc) in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
            self._corrupt = (f"the database {self.path} is corrupt ({exc}): writes stop; check it with PRAGMA "
                             "integrity_check and restore it from a backup")
            log.error("%s", self._corrupt)

    # reads

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def run() -> T:
            assert self._reader is not None
            try:
                return fn(self._reader)
            except sqlite3.Error as exc:
                self._note_corrupt(exc)
                raise StoreUnavailable(f"sqlite read of {self.path} failed: {exc}") from exc

        if self._reader is None:
            raise StoreUnavailable("the store is not open")
        return await anyio.to_thread.run_sync(run, limiter=self._read_limiter)

    # producers

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        def op(conn: sqlite3.Connection, batch: _Batch) -> tuple[Task, bool]:
            existing = _existing(conn, new)
            if existing is not None:
                return existing, False
            _check_room(conn, batch, 1, max_queued)
            return _insert(conn, new, now), True

        result: tuple[Task, bool] = await self._write(op)
        return result

    async def add_many(self, batch_: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[tuple[str, bool]]:
        def op(conn: sqlite3.Connection, batch: _Batch) -> list[tuple[str, bool]]:
            keys = [n.idempotency_key for n in batch_ if n.idempotency_key]
            if len(keys) != len(set(keys)):
                raise Conflict("idempotency_key repeats within the batch")
            existing = _existing_ids(conn, batch_) if keys else {}
            fresh = [n for n in batch_ if n.idempotency_key not in existing]
            if fresh:  # a batch sent again whole is answered even when the queue is full, as a single submit
                _check_room(conn, batch, len(fresh), max_queued)
            return batch_answer(batch_, existing, _insert_many(conn, fresh, now))

        added: list[tuple[str, bool]] = await self._write(op)
        return added

    async def get(self, task_id: str) -> Task:
        def read(conn: sqlite3.Connection) -> Task:
            row = conn.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE id = ?", (task_id,)).fetchone()
            if row is None:
                raise TaskNotFound(task_id)
            results = conn.execute(f"SELECT {RESULT_COLUMNS} FROM results WHERE task_id = ? "
                                   "ORDER BY created_at, sequence", (task_id,)).fetchall()
            task = _task(row, attempts=_attempts(conn, [task_id]).get(task_id, ()))
            return _replace_results(task, tuple(result_of(r) for r in results))

        return await self._read(read)

    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                   cursor: str | None = None) -> Page:
        def read(conn: sqlite3.Connection) -> Page:
            where, args = ["1 = 1"], []
            for column, value in (("state", state), ("type", type)):
                if value is not None:
                    where.append(f"{column} = ?")
                    args.append(str(value))
            if cursor is not None:
                where.append("id < ?")
                args.append(cursor)
            rows = conn.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE {' AND '.join(where)} "
                                "ORDER BY id DESC LIMIT ?", (*args, limit + 1)).fetchall()
            attempts = _attempts(conn, [r[0] for r in rows[:limit]])
            tasks = [_task(r, attempts=attempts.get(r[0], ())) for r in rows[:limit]]
            return Page(tasks, tasks[-1].id if len(rows) > limit else None)

        return await self._read(read)

    async def counts(self) -> dict[State, int]:
        def read(conn: sqlite3.Connection) -> dict[State, int]:
            rows = conn.execute(f"SELECT state, count(*) FROM tasks WHERE state IN {UNFINISHED_SQL} "
                                "GROUP BY state").fetchall()
            return {State(s): n for s, n in rows}

        return await self._read(read)

    async def request_cancel(self, task_id: str, *, now: float) -> CancelAnswer:
        def op(conn: sqlite3.Connection, batch: _Batch) -> CancelAnswer:
            row = conn.execute("SELECT state, type FROM tasks WHERE id = ?", (task_id,)).fetchone()
            if row is None:
                raise TaskNotFound(task_id)
            current = State(row[0])
            target = cancel_step(current)
            if target is current:
                return CancelAnswer(target, False, row[1])
            if target is State.CANCELLED:
                conn.execute("UPDATE tasks SET state = ?, phase = NULL, error = ?, finished_at = ?, updated_at = ? "
                             "WHERE id = ?", (target, json.dumps(CANCELLED_ON_REQUEST.to_json()), now, now, task_id))
                batch.queued = None  # the queue shrank: recount before the next max_queued check
            else:
                conn.execute("UPDATE tasks SET state = ?, cancel_requested_at = ?, updated_at = ? WHERE id = ?",
                             (target, now, now, task_id))
            return CancelAnswer(target, True, row[1])

        answer: CancelAnswer = await self._write(op)
        return answer

    async def retry(self, task_id: str, *, now: float, max_queued: int | None = None) -> Task:
        def op(conn: sqlite3.Connection, batch: _Batch) -> Task:
            row = conn.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE id = ?", (task_id,)).fetchone()
            if row is None:
                raise TaskNotFound(task_id)
            target = retry_step(State(row[4]))
            _check_room(conn, batch, 1, max_queued)
            # A new budget: attempt counts from zero again; attempts[].number keeps counting every row.
            conn.execute("UPDATE tasks SET state = ?, attempt = 0, interruptions = 0, available_at = ?, "
                         "updated_at = ?, finished_at = NULL, error = NULL, progress = NULL WHERE id = ?",
                         (target, now, now, task_id))
            row = conn.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE id = ?", (task_id,)).fetchone()
            return _task(row, attempts=_attempts(conn, [task_id]).get(task_id, ()))

        task: Task = await self._write(op)
        return task

    # workers

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        claimed: list[Claimed] = await self._write(_ClaimOp(worker, where, limit, now, lease_s))
        return claimed

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        def op(conn: sqlite3.Connection, batch: _Batch) -> dict[str, LeaseLost]:
            lost = {}
            for lease in leases:
                cur = conn.execute(f"UPDATE tasks SET lease_expires_at = ? WHERE {FENCE} AND state IN "
                                   f"{WORKING_SQL} AND lease_expires_at > ?",
                                   (now + lease_s, lease.task_id, lease.attempt_id, lease.token, now))
                if cur.rowcount == 0:
                    lost[lease.attempt_id] = _why_lost(conn, lease)
            return lost

        lost: dict[str, LeaseLost] = await self._write(op)
        return lost

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        def op(conn: sqlite3.Connection, batch: _Batch) -> dict[str, LeaseLost]:
            lost: dict[str, LeaseLost] = {}
            for i in range(0, len(notes), LEASE_CHUNK):
                lost.update(_note_phases(conn, notes[i:i + LEASE_CHUNK], now))
            return lost

        lost: dict[str, LeaseLost] = await self._write(op)
        return lost

    async def record_result(self, lease: Lease, batch_: ResultBatch, *, now: float) -> ResultBatch:
        def op(conn: sqlite3.Connection, batch: _Batch) -> ResultBatch:
            row = conn.execute(f"SELECT state FROM tasks WHERE {FENCE} AND lease_expires_at > ?",
                               (lease.task_id, lease.attempt_id, lease.token, now)).fetchone()
            if row is None or row[0] not in (State.LEASED, State.RUNNING):
                raise _why_lost(conn, lease)
            earlier = conn.execute(f"SELECT {RESULT_COLUMNS} FROM results WHERE idempotency_key = ?",
                                   (batch_.idempotency_key,)).fetchone()
            if earlier is not None:
                if earlier[3] != batch_.sha256:
                    raise Conflict(f"result key {batch_.idempotency_key} was stored with another sha256")
                return result_of(earlier)
            conn.execute("INSERT INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (batch_.idempotency_key, lease.task_id, lease.attempt_id, batch_.plugin,
                          batch_.sequence, batch_.sha256, batch_.final, json.dumps(batch_.payload), now))
            return replace(batch_, attempt_id=lease.attempt_id)

        ack: ResultBatch = await self._write(op)
        return ack

    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        result = (await self.finish_many([Ending(lease, outcome, now)], policy=policy))[0]
        if isinstance(result, TidepoolError):
            raise result
        return result

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        if not endings:
            return []
        try:
            results: list[State | TidepoolError] = await self._write(_FinishOp(tuple(endings), policy))
        except StoreUnavailable as exc:  # the transaction failed as a whole (or the store is closed): none written
            return [exc] * len(endings)
        return results

    # schedules

    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        def op(conn: sqlite3.Connection, batch: _Batch) -> Schedule:
            row = conn.execute(f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE name = ?", (schedule.name,)).fetchone()
            saved = schedules.merge(None if row is None else schedule_of(row), schedule, now)
            conn.execute("INSERT OR REPLACE INTO schedules VALUES (?, ?, ?, ?, ?, ?, ?)", schedule_values(saved))
            return saved

        saved: Schedule = await self._write(op)
        return saved

    async def list_schedules(self) -> list[Schedule]:
        def read(conn: sqlite3.Connection) -> list[Schedule]:
            rows = conn.execute(f"SELECT {SCHEDULE_COLUMNS} FROM schedules ORDER BY name").fetchall()
            return [schedule_of(r) for r in rows]

        return await self._read(read)

    async def delete_schedule(self, name: str, *, config_node: str | None = None) -> None:
        def op(conn: sqlite3.Connection, batch: _Batch) -> None:
            if conn.execute("DELETE FROM schedules WHERE name = ? AND "
                            "(? IS NULL OR json_extract(spec, '$.config_node') = ?)",
                            (name, config_node, config_node)).rowcount == 0:
                raise ScheduleNotFound(name)

        await self._write(op)

    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule:
        def op(conn: sqlite3.Connection, batch: _Batch) -> Schedule:
            row = conn.execute(f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise ScheduleNotFound(name)
            saved = schedules.set_paused(schedule_of(row), paused, now)
            conn.execute("INSERT OR REPLACE INTO schedules VALUES (?, ?, ?, ?, ?, ?, ?)", schedule_values(saved))
            return saved

        saved: Schedule = await self._write(op)
        return saved

    async def fire_schedules(self, *, now: float, new_task: Callable[[Schedule, float], NewTask] | None = None,
                             defines: Callable[[str], bool] = lambda type_name: True,
                             max_queued: int | None = None) -> list[Fired]:
        """Fire every due tick in one transaction: tasks created and next_run_at advanced together."""
        def op(conn: sqlite3.Connection, batch: _Batch) -> list[Fired]:
            rows = conn.execute(f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE paused = 0 AND next_run_at <= ?",
                                (now,)).fetchall()
            fired: list[Fired] = []
            for row in rows:
                schedule = schedule_of(row)
                if not defines(schedule.type):
                    continue
                outcome, saved = schedules.fire(schedule, now, new_task=new_task,
                                                running=lambda task_id: _is_active(conn, task_id),
                                                add=lambda new: _add_once(conn, batch, new, now, max_queued))
                conn.execute("INSERT OR REPLACE INTO schedules VALUES (?, ?, ?, ?, ?, ?, ?)", schedule_values(saved))
                fired.extend(outcome)
            if fired:
                batch.queued = None
            return fired

        fired: list[Fired] = await self._write(op)
        return fired

    # the reconciler

    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None, interrupted: frozenset[str] = frozenset(),
                            ) -> list[Expired]:
        def op(conn: sqlite3.Connection, batch: _Batch) -> list[Expired]:
            if node_id is None:
                sql, args = "lease_expires_at <= ?", (now,)
            else:
                sql, args = "node_id = ? AND lease_instance IS NOT ?", (node_id, keep_instance)  # type: ignore
            rows = conn.execute(
                "SELECT state, attempt, max_attempts, interruptions, lease_expires_at, id, lease_attempt_id, "
                f"lease_token, type FROM tasks WHERE state IN ('leased', 'running', 'cancelling') AND {sql}",
                args).fetchall()
            expired = []
            for row in rows:
                lease = Lease(row[5], row[6], row[7], row[4])
                state = _end(conn, lease, expiry_outcome(lease.attempt_id, interrupted), row, now, policy, batch)
                expired.append(Expired(lease.task_id, lease.attempt_id, state, row[8]))
            return expired

        expired: list[Expired] = await self._write(op)
        return expired

    async def promote_due(self, *, now: float) -> int:
        def op(conn: sqlite3.Connection, batch: _Batch) -> int:
            cur = conn.execute("UPDATE tasks SET state = 'pending', updated_at = ? "
                               "WHERE state = 'retry_wait' AND available_at <= ?", (now, now))
            return cur.rowcount

        promoted: int = await self._write(op)
        return promoted

    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[Ended]:
        def op(conn: sqlite3.Connection, batch: _Batch) -> list[Ended]:
            rows = conn.execute("SELECT id, lease_attempt_id, type FROM tasks WHERE state = 'cancelling' "
                                "AND cancel_requested_at <= ?", (now - deadline_s,)).fetchall()
            error = json.dumps(cancel_deadline_error(deadline_s).to_json())
            for task_id, attempt_id, _ in rows:
                conn.execute("UPDATE attempts SET status = 'cancelled', finished_at = ?, error = ? WHERE id = ?",
                             (now, error, attempt_id))
                conn.execute("UPDATE tasks SET state = ?, phase = NULL, error = ?, finished_at = ?, updated_at = ?, "
                             "lease_token = NULL WHERE id = ?",
                             (step(State.CANCELLING, Event.CANCEL_ACK), error, now, now, task_id))
            return [Ended(r[0], r[2]) for r in rows]

        done: list[Ended] = await self._write(op)
        return done

    async def prune(self, *, before: float) -> int:
        def op(conn: sqlite3.Connection, batch: _Batch) -> int:
            old = f"SELECT id FROM tasks WHERE finished_at < ? AND state IN {TERMINAL_SQL}"
            conn.execute(f"DELETE FROM results WHERE task_id IN ({old})", (before,))
            conn.execute(f"DELETE FROM attempts WHERE task_id IN ({old})", (before,))
            conn.execute("DELETE FROM nodes WHERE heartbeat_at < ?", (before,))
            return conn.execute(f"DELETE FROM tasks WHERE id IN ({old})", (before,)).rowcount

        pruned: int = await self._write(op)
        return pruned

    async def queued_tag_sets(self) -> list[frozenset[str]]:
        def read(conn: sqlite3.Connection) -> list[frozenset[str]]:
            rows = conn.execute(f"SELECT DISTINCT required_tags FROM tasks WHERE state IN {QUEUED_SQL} "
                                "AND required_tags != '[]'").fetchall()
            return [frozenset(json.loads(r[0])) for r in rows]

        return await self._read(read)

    async def fail_unserviceable(self, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
        error = json.dumps(TaskError("unserviceable", message, retryable=False).to_json())
        target = step(State.PENDING, Event.UNSERVICEABLE)  # retry_wait moves the same way

        def op(conn: sqlite3.Connection, batch: _Batch) -> list[Ended]:
            rows = conn.execute(
                "UPDATE tasks SET state = ?, phase = NULL, error = ?, finished_at = ?, updated_at = ? "
                f"WHERE state IN {QUEUED_SQL} AND required_tags = ? RETURNING id, type",
                (target, error, now, now, json.dumps(sorted(tags)))).fetchall()  # stored as a sorted JSON list
            if batch.queued is not None:
                batch.queued -= len(rows)
            return [Ended(r[0], r[1]) for r in rows]

        done: list[Ended] = await self._write(op)
        return done

    # the fleet: one host, so the daemon's lock file keeps one process per node id, and nothing to hear

    async def lock_node(self, node_id: str, instance_id: str) -> None:
        """The daemon's lock file keeps one process per node id; a lock file deleted while its daemon ran
        would not, so the node's own row is asked as well: a live process of this node on this host."""
        def read(conn: sqlite3.Connection) -> Any:
            return conn.execute(f"SELECT {NODE_COLUMNS} FROM nodes WHERE node_id = ?", (node_id,)).fetchone()

        row = await self._read(read)
        holder = None if row is None else _node(row)
        if holder is not None and holder.instance_id != instance_id and _alive_here(holder):
            raise ConfigError(f"node {node_id} already runs on {self.path}: pid {holder.pid} (instance "
                              f"{holder.instance_id}, heard from {time.time() - holder.heartbeat_at:.0f}s ago); "
                              "stop it or give this daemon another node.id")

    async def save_node(self, node: Node) -> None:
        row = node_values(node, task_types=json.dumps(list(node.task_types)))

        def op(conn: sqlite3.Connection, batch: _Batch) -> None:
            conn.execute(f"INSERT OR REPLACE INTO nodes ({NODE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         row)

        await self._write(op)

    async def list_nodes(self) -> list[Node]:
        def read(conn: sqlite3.Connection) -> list[Node]:
            rows = conn.execute(f"SELECT {NODE_COLUMNS} FROM nodes ORDER BY node_id").fetchall()
            return [_node(r) for r in rows]

        return await self._read(read)

    async def watch(self, wake: Callable[[int], None], *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await anyio.sleep_forever()


class _Grouped:
    """An op the writer runs together with the ops of its kind that queued right behind it."""

    MAX_GROUP = 256

    def group_key(self) -> object:
        return type(self)

    @classmethod
    def run_group(cls, conn: sqlite3.Connection, batch: _Batch, ops: list[Any]) -> list[tuple[Any, None]]:
        raise NotImplementedError


@dataclass(frozen=True)
class _ClaimOp(_Grouped):
    """Claims of one filter share a single ordered SELECT, then split its rows in queue order."""

    worker: Worker
    where: ClaimFilter
    limit: int
    now: float
    lease_s: float

    def group_key(self) -> object:
        return (_ClaimOp, self.where)

    @classmethod
    def run_group(cls, conn: sqlite3.Connection, batch: _Batch, ops: list[Any]) -> list[tuple[Any, None]]:
        rows = iter(_claimable(conn, ops[0].where, sum(o.limit for o in ops), min(o.now for o in ops)))
        results: list[tuple[Any, None]] = []
        leased: list[tuple[Worker, Claimed, float]] = []
        for op in ops:
            mine = [r for _, r in zip(range(op.limit), rows, strict=False)]
            claimed = [Claimed(_task(r, leased_by=op.worker.node_id, now=op.now),
                               Lease(r[0], new_id(op.now), new_token(), op.now + op.lease_s)) for r in mine]
            leased.extend((op.worker, c, op.now) for c in claimed)
            results.append((claimed, None))
        if leased:
            _lease(conn, leased)
        if batch.queued is not None:
            batch.queued -= len(leased)
        return results


@dataclass(frozen=True, eq=False)
class _FinishOp(_Grouped):
    """Attempts ending: the bare successes of the finish_many calls of one transaction completed a few
    statements at a time, every other ending (and every success that fast path refused) alone in its own
    savepoint."""

    endings: tuple[Ending, ...]
    policy: RetryPolicy

    @classmethod
    def run_group(cls, conn: sqlite3.Connection, batch: _Batch, ops: list[Any]) -> list[tuple[Any, None]]:
        flat: list[tuple[Ending, RetryPolicy]] = [(e, op.policy) for op in ops for e in op.endings]
        fast = completable_at_once([e for e, _ in flat])
        done = _complete(conn, [(e.lease, e.now, progress_text(e.outcome.progress))
                                for (e, _), f in zip(flat, fast, strict=True) if f])
        results: list[State | TidepoolError] = []
        for (e, policy), f in zip(flat, fast, strict=True):
            if f and e.lease.attempt_id in done:
                results.append(State.COMPLETED)
                continue
            state, error = _run_alone(conn, batch, functools.partial(_finish_one, ending=e, policy=policy))
            results.append(state if error is None else error)
        answers = iter(results)
        return [([next(answers) for _ in op.endings], None) for op in ops]


def _groups(ops: list[tuple[Op, asyncio.Future[Any]]]) -> list[list[tuple[Op, asyncio.Future[Any]]]]:
    """Split a batch into runs: grouped ops of one key together (at most MAX_GROUP), every other op alone.

    The ops of one batch were all in flight at once, so any serial order of them is a valid history:
    gathering claims and completions of the whole batch lets each kind share one statement.
    """
    runs: list[list[tuple[Op, asyncio.Future[Any]]]] = []
    open_runs: dict[object, list[tuple[Op, asyncio.Future[Any]]]] = {}
    for item in ops:
        op = item[0]
        if not isinstance(op, _Grouped):
            runs.append([item])
            continue
        key = op.group_key()
        run = open_runs.get(key)
        if run is None or len(run) >= _Grouped.MAX_GROUP:
            run = open_runs[key] = []
            runs.append(run)
        run.append(item)
    return runs


def _is_active(conn: sqlite3.Connection, task_id: str) -> bool:
    row = conn.execute("SELECT state FROM tasks WHERE id = ?", (task_id,)).fetchone()
    return row is not None and not State(row[0]).terminal


def _add_once(conn: sqlite3.Connection, batch: _Batch, new: NewTask, now: float, max_queued: int | None) -> str | None:
    """The new task's id, or None when a task for this key exists already (a tick fires once); QueueFull
    past max_queued."""
    if conn.execute("SELECT 1 FROM tasks WHERE idempotency_key = ?", (new.idempotency_key,)).fetchone():
        return None
    _check_room(conn, batch, 1, max_queued)
    return _insert_many(conn, [new], now)[0]


def _drain(ops: queue.SimpleQueue[Any]) -> list[Any]:
    items = []
    while True:
        try:
            items.append(ops.get_nowait())
        except queue.Empty:
            return items


def _run_alone(conn: sqlite3.Connection, batch: _Batch, op: Any) -> tuple[Any, TidepoolError | None]:
    """One plain op inside a savepoint: whatever it raises fails this op only, not the transaction."""
    conn.execute("SAVEPOINT op")
    try:
        result = op(conn, batch)
    except Exception as exc:
        if _error_code(exc) in FILE_FAULTS or not conn.in_transaction:  # not this op's fault: the batch fails
            raise
        conn.execute("ROLLBACK TO op")
        conn.execute("RELEASE op")
        batch.queued = None  # the op may have counted itself in before failing: recount
        if isinstance(exc, TidepoolError):  # Conflict, LeaseLost, InvalidTransition, ...
            return None, exc
        log.error("sqlite op failed and was rolled back alone: %r", exc)
        error = StoreUnavailable(f"sqlite write failed: {exc}")
        error.__cause__ = exc
        return None, error
    conn.execute("RELEASE op")
    return result, None


# What the file did, not the op: SQLite may have rolled the whole transaction back already.
FILE_FAULTS = frozenset({sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB,
                         sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_NOMEM})


def _error_code(exc: BaseException) -> int | None:
    """SQLite's primary result code of an sqlite3 error (its extended code's low byte), else None."""
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def _settle(outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, result, error in outcomes:
        if future.cancelled():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


# SQL helpers, all run inside the writer's transaction or the reader's connection


def _existing(conn: sqlite3.Connection, new: NewTask) -> Task | None:
    if not new.idempotency_key:
        return None
    row = conn.execute(f"SELECT {TASK_COLUMNS}, fingerprint FROM tasks WHERE idempotency_key = ?",
                       (new.idempotency_key,)).fetchone()
    if row is None:
        return None
    if row[-1] != new.fingerprint():
        raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another body")
    return _task(row[:-1])


def _existing_ids(conn: sqlite3.Connection, batch: Sequence[NewTask]) -> dict[str | None, str]:
    """The tasks the batch's keys already name, by key; Conflict if one was used with another body."""
    found: dict[str | None, str] = {}
    keyed = {n.idempotency_key: n for n in batch if n.idempotency_key}
    keys = list(keyed)
    for i in range(0, len(keys), LEASE_CHUNK):
        chunk = keys[i:i + LEASE_CHUNK]
        for key, task_id, fingerprint in conn.execute(
                f"SELECT idempotency_key, id, fingerprint FROM tasks WHERE idempotency_key IN "
                f"({','.join('?' * len(chunk))})", chunk):
            if fingerprint != keyed[key].fingerprint():
                raise Conflict(f"idempotency_key {key!r} was used with another body")
            found[key] = task_id
    return found


def _check_room(conn: sqlite3.Connection, batch: _Batch, n: int, max_queued: int | None) -> None:
    if max_queued is None:
        batch.queued = None  # an unchecked insert still grows the queue: recount at the next check
        return
    queued = batch.queued_count(conn)
    check_room(queued, n, max_queued)
    batch.queued = queued + n


def _insert(conn: sqlite3.Connection, new: NewTask, now: float) -> Task:
    task_id = _insert_many(conn, [new], now)[0]
    return _task(conn.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE id = ?", (task_id,)).fetchone())


def _insert_many(conn: sqlite3.Connection, batch: Sequence[NewTask], now: float) -> list[str]:
    rows = [(new_id(now), n.type, json.dumps(n.payload), n.priority, n.max_attempts, n.timeout_s,
             json.dumps(sorted(n.required_tags)) if n.required_tags else "[]", n.idempotency_key,
             n.fingerprint(), now, now, n.available_at if n.available_at is not None else now) for n in batch]
    conn.executemany(
        "INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags, "
        "idempotency_key, fingerprint, created_at, updated_at, available_at) "
        "VALUES (?, ?, ?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    return [r[0] for r in rows]


def _claimable(conn: sqlite3.Connection, where: ClaimFilter, limit: int, now: float) -> list[Any]:
    sql = [f"SELECT {TASK_COLUMNS} FROM tasks INDEXED BY tasks_queue WHERE state IN {QUEUED_SQL} "
           "AND available_at <= ? AND attempt < max_attempts"]
    args: list[Any] = [now]
    if "*" not in where.type_globs:
        sql.append("AND (" + " OR ".join("type GLOB ?" for _ in where.type_globs) + ")")
        args.extend(where.type_globs)
    tag_clauses = ["required_tags = '[]'"]
    for tags in where.tag_sets:
        marks = ",".join("?" * len(tags))
        tag_clauses.append(f"NOT EXISTS (SELECT 1 FROM json_each(required_tags) WHERE value NOT IN ({marks}))")
        args.extend(sorted(tags))
    sql.append("AND (" + " OR ".join(tag_clauses) + ")")
    sql.append("ORDER BY priority DESC, created_at, id LIMIT ?")
    args.append(limit)
    return conn.execute(" ".join(sql), args).fetchall()


def _lease(conn: sqlite3.Connection, leased: list[tuple[Worker, Claimed, float]]) -> None:
    """Lease the claimed rows and open their attempts: one statement each per chunk, not one per row."""
    for i in range(0, len(leased), LEASE_CHUNK):
        chunk = leased[i:i + LEASE_CHUNK]
        rows = ",".join("(?, ?, ?, ?, ?, ?, ?)" for _ in chunk)
        conn.execute(
            "UPDATE tasks SET state = 'leased', attempt = attempt + 1, node_id = v.column2, phase = NULL, "
            "progress = NULL, error = NULL, updated_at = v.column3, lease_attempt_id = v.column4, "
            "lease_token = v.column5, lease_expires_at = v.column6, lease_instance = v.column7 "
            f"FROM (VALUES {rows}) AS v WHERE tasks.id = v.column1",
            [x for w, c, now in chunk for x in (c.task.id, w.node_id, now, c.lease.attempt_id, c.lease.token,
                                                 c.lease.expires_at, w.instance_id)])
        conn.execute(
            "INSERT INTO attempts (id, task_id, number, node_id, instance_id, worker_id, status, started_at) "
            "VALUES " + ",".join("(?, ?, (SELECT count(*) + 1 FROM attempts WHERE task_id = ?), ?, ?, ?, "
                                 "'leased', ?)" for _ in chunk),
            [x for w, c, now in chunk for x in (c.lease.attempt_id, c.task.id, c.task.id, w.node_id,
                                                 w.instance_id, w.worker_id, now)])


def _note_phases(conn: sqlite3.Connection, notes: Sequence[PhaseNote], now: float) -> dict[str, LeaseLost]:
    """Write the notes of live leases, two statements for the lot: the lease keeper flushes every running
    attempt's notes together, and a statement per note held the writer ~4 ms for 50 of them, with every
    claim queued behind it (measured in W2). The notes refused are found only when some were."""
    rows = ",".join("(?, ?, ?, ?, ?)" for _ in notes)
    cur = conn.execute(
        "UPDATE tasks SET phase = v.column4, progress = coalesce(v.column5, progress), updated_at = ?, "
        f"state = 'running' FROM (VALUES {rows}) AS v WHERE tasks.id = v.column1 "
        "AND tasks.lease_attempt_id = v.column2 AND tasks.lease_token = v.column3 "
        f"AND +tasks.state IN {WORKING_SQL} AND tasks.lease_expires_at > ?",
        [now, *(x for n in notes for x in (n.lease.task_id, n.lease.attempt_id, n.lease.token, n.phase,
                                           progress_text(n.progress))), now])
    lost: dict[str, LeaseLost] = {}
    if cur.rowcount != len(notes):  # a written note leaves its task running under the same live lease
        for n in notes:
            if conn.execute(f"SELECT 1 FROM tasks WHERE {FENCE} AND state = 'running' AND lease_expires_at > ?",
                            (n.lease.task_id, n.lease.attempt_id, n.lease.token, now)).fetchone() is None:
                lost[n.lease.attempt_id] = _why_lost(conn, n.lease)
    written = [n.lease.attempt_id for n in notes if n.lease.attempt_id not in lost]
    if written:  # an attempt's first note starts it
        conn.execute(f"UPDATE attempts SET status = 'running' WHERE status = 'leased' "
                     f"AND id IN ({','.join('?' * len(written))})", written)
    return lost


def _why_lost(conn: sqlite3.Connection, lease: Lease) -> LeaseLost:
    row = conn.execute(f"SELECT state FROM tasks WHERE {FENCE}",
                       (lease.task_id, lease.attempt_id, lease.token)).fetchone()
    if row is not None and row[0] == State.CANCELLING:
        return TaskCancelling(lease.task_id, lease.attempt_id)
    return LeaseLost(lease.task_id, lease.attempt_id)


def _complete(conn: sqlite3.Connection, ends: list[tuple[Lease, float, str | None]]) -> set[str]:
    """Complete bare successes, each fenced at its own `now`, two statements per chunk (three when the fence
    refused some); the attempt ids completed. At most one ending per task."""
    done: set[str] = set()
    for i in range(0, len(ends), LEASE_CHUNK):
        chunk = ends[i:i + LEASE_CHUNK]
        # The join picks the rows by primary key; `+state` keeps the planner off the state index. No
        # RETURNING: each returned row is a step that gives the GIL away, and nearly always all succeed.
        cur = conn.execute(
            "UPDATE tasks SET state = 'completed', phase = NULL, progress = coalesce(v.column5, progress), "
            "error = NULL, updated_at = v.column4, finished_at = v.column4, lease_token = NULL "
            f"FROM (VALUES {','.join('(?, ?, ?, ?, ?)' for _ in chunk)}) "
            "AS v WHERE tasks.id = v.column1 AND tasks.lease_attempt_id = v.column2 AND tasks.lease_token = v.column3 "
            f"AND +tasks.state IN {WORKING_SQL} AND tasks.lease_expires_at > v.column4",
            [x for lease, now, p in chunk for x in (lease.task_id, lease.attempt_id, lease.token, now, p)])
        if cur.rowcount != len(chunk):  # some were fenced off: the ones completed just now still have an open attempt
            completed = {r[0] for r in conn.execute(
                "SELECT a.id FROM attempts a JOIN tasks t ON t.id = a.task_id "
                f"WHERE a.id IN ({','.join('?' * len(chunk))}) AND a.status IN ('leased', 'running') "
                "AND t.lease_attempt_id = a.id AND t.state = 'completed'", [end[0].attempt_id for end in chunk])}
            chunk = [end for end in chunk if end[0].attempt_id in completed]
        if chunk:
            conn.execute(f"UPDATE attempts SET status = 'succeeded', finished_at = v.column2 FROM "
                         f"(VALUES {','.join('(?, ?)' for _ in chunk)}) AS v WHERE attempts.id = v.column1",
                         [x for lease, now, _ in chunk for x in (lease.attempt_id, now)])
        done.update(lease.attempt_id for lease, _, _ in chunk)
    return done


def _finish_one(conn: sqlite3.Connection, batch: _Batch, *, ending: Ending, policy: RetryPolicy) -> State:
    """End one attempt the slow way: read its task behind the fence, decide, write."""
    lease, now = ending.lease, ending.now
    row = conn.execute(
        f"SELECT state, attempt, max_attempts, interruptions, lease_expires_at FROM tasks WHERE {FENCE}",
        (lease.task_id, lease.attempt_id, lease.token)).fetchone()
    if row is None or not may_end(State(row[0]), row[4], now):
        raise _why_lost(conn, lease)
    return _end(conn, lease, ending.outcome, row, now, policy, batch)


def _end(conn: sqlite3.Connection, lease: Lease, outcome: Outcome, row: Any, now: float,
         policy: RetryPolicy, batch: _Batch) -> State:
    """Write how an attempt ended; `row` is (state, attempt, max_attempts, interruptions, ...)."""
    state, attempt, max_attempts, interruptions = State(row[0]), row[1], row[2], row[3]
    end = decide_end(state, outcome, attempt=attempt, max_attempts=max_attempts, interruptions=interruptions,
                     policy=policy, now=now)
    error = None if end.error is None else json.dumps(end.error.to_json())
    conn.execute("UPDATE attempts SET status = ?, finished_at = ?, error = ?, exit_status = ?, stderr_tail = ? "
                 "WHERE id = ?", (end.attempt_status, now, error, outcome.exit_status, outcome.stderr_tail,
                                  lease.attempt_id))
    queued = end.available_at is not None
    uncount = 1 if end.uncount_attempt else 0
    conn.execute(
        "UPDATE tasks SET state = ?, phase = NULL, progress = coalesce(?, progress), error = ?, updated_at = ?, "
        "attempt = attempt - ?, interruptions = interruptions + ?, available_at = coalesce(?, available_at), "
        "finished_at = ?, lease_token = NULL WHERE id = ?",
        (end.state, progress_text(outcome.progress), error, now, uncount, uncount, end.available_at,
         None if queued else now, lease.task_id))
    if queued and batch.queued is not None:
        batch.queued += 1
    return end.state


def _node(r: Any) -> Node:
    return node_of(r, task_types=json.loads(r[9]))


def _alive_here(node: Node) -> bool:
    """Whether the process a node row names still runs on this host, and is that process (a pid reused
    since was born after the node started)."""
    if node.stopped_at is not None or node.hostname != socket.gethostname() or node.pid == os.getpid():
        return False
    try:
        process = psutil.Process(node.pid)
        born: float = process.create_time()
        return born <= node.started_at + 1.0 and process.status() != psutil.STATUS_ZOMBIE  # killed, not reaped
    except psutil.Error:
        return False


def _task(row: Any, *, attempts: tuple[Attempt, ...] = (), leased_by: str | None = None,
          now: float | None = None) -> Task:
    """A Task from a TASK_COLUMNS row; with leased_by, as it reads once this claim commits."""
    return task_of(row, required_tags=loads(row[11]), attempts=attempts, leased_by=leased_by, now=now)


def _attempts(conn: sqlite3.Connection, task_ids: list[str]) -> dict[str, tuple[Attempt, ...]]:
    if not task_ids:
        return {}
    marks = ",".join("?" * len(task_ids))
    found: dict[str, list[Attempt]] = {}
    for r in conn.execute(f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE task_id IN ({marks}) "
                          "ORDER BY task_id, number", task_ids):
        found.setdefault(r[1], []).append(attempt_of(r))
    return {k: tuple(v) for k, v in found.items()}


def _replace_results(task: Task, results: tuple[ResultBatch, ...]) -> Task:
    import dataclasses

    return dataclasses.replace(task, results=results)
