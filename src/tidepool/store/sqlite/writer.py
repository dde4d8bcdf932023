"""The one writer thread of a SQLite store, and its group commit.

Every write is an op queued to one thread that owns the only writing connection. The thread takes
whatever ops have queued up and runs them in one transaction, so many workers share each fsync (here
~4k single-step transactions/s, ~45k steps/s grouped). Each plain op runs inside its own savepoint, so
an op that raises (LeaseLost, Conflict, or a SQLite error) fails alone and the others of its transaction
stand; claims and completions of a batch are gathered into shared statements (Grouped). Only a failing
transaction as a whole fails every op with StoreUnavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import anyio.to_thread

from ...errors import StoreUnavailable, TidepoolError
from .database import Database, Q, error_code

log = logging.getLogger("tidepool.store.sqlite")
GROUP_PAUSE_S = 0.0005  # under load, how long the writer waits for more ops to share a transaction
GROUP_PAUSE_FROM = 8  # ops in this batch and the last before a pause can pay for itself (see _loop)
# What the file did, not the op: SQLite may have rolled the whole transaction back already.
FILE_FAULTS = frozenset({sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB,
                         sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_NOMEM})


@dataclass
class Batch:
    """Facts shared by the ops of one transaction."""

    queued: int | None = None
    moves: list[Any] = field(default_factory=list)  # the scans' moves (ScanMove) its ops made, told after commit

    def queued_count(self, conn: sqlite3.Connection) -> int:
        if self.queued is None:
            self.queued = int(conn.execute(Q["count_queued"]).fetchone()[0])
        return self.queued


class Grouped:
    """An op the writer runs together with the ops of its kind that queued right behind it."""

    MAX_GROUP = 256

    def group_key(self) -> object:
        return type(self)

    @classmethod
    def run_group(cls, conn: sqlite3.Connection, batch: Batch, ops: list[Any]) -> list[tuple[Any, None]]:
        raise NotImplementedError


Op: TypeAlias = "Callable[[sqlite3.Connection, Batch], Any] | Grouped"
Queued: TypeAlias = "tuple[Op, asyncio.Future[Any]]"
Settled: TypeAlias = "tuple[asyncio.Future[Any], Any, BaseException | None]"


class Writer:
    """Runs ops on the writing connection, a transaction per batch of them, and answers each op's future."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._ops: queue.SimpleQueue[Queued | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.on_moves: Callable[[list[Any]], None] | None = None  # told the scans' moves of each commit

    def start(self, conn: sqlite3.Connection) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._loop_on, args=(conn,), name="tidepool-sqlite-writer",
                                        daemon=True)
        self._thread.start()

    async def close(self) -> None:
        if self._thread is not None:
            self._closing = True  # from here on writes are refused rather than queued behind the end
            self._ops.put(None)
            await anyio.to_thread.run_sync(self._thread.join)
            self._thread = None

    async def write(self, op: Op) -> Any:
        if self._thread is None or self._loop is None or self._closing:
            raise StoreUnavailable("the store is not open")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._ops.put((op, future))
        return await future

    def _loop_on(self, conn: sqlite3.Connection) -> None:
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
                    self._answer(self._run_batch(conn, ops))
        finally:
            conn.close()
            self._answer([(item[1], None, StoreUnavailable("the store closed")) for item in _drain(self._ops)
                          if item is not None])

    def _answer(self, outcomes: list[Settled]) -> None:
        if outcomes and self._loop is not None:
            self._loop.call_soon_threadsafe(_settle, outcomes)

    def _take_queued(self, queued: list[Queued | None]) -> bool:
        """Append every op queued so far; True once the close sentinel (None) is among them."""
        queued.extend(_drain(self._ops))
        return None in queued

    def _run_batch(self, conn: sqlite3.Connection, ops: list[Queued]) -> list[Settled]:
        batch = Batch()
        outcomes: list[Settled] = []
        try:
            if self._db.corrupt:
                raise StoreUnavailable(self._db.corrupt)
            self._db.still_ours()
            conn.execute("BEGIN IMMEDIATE")
            for group in _groups(ops):
                op = group[0][0]
                if isinstance(op, Grouped):
                    results = op.run_group(conn, batch, [o for o, _ in group])
                    outcomes.extend((future, *r) for (_, future), r in zip(group, results, strict=True))
                    continue
                outcomes.append((group[0][1], *run_alone(conn, batch, op)))
            conn.execute("COMMIT")
        except Exception as exc:  # the whole transaction is gone: tell every op
            return [(future, None, self._failed(conn, exc)) for _, future in ops]
        if batch.moves and self.on_moves is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_moves, batch.moves)
        return outcomes

    def _failed(self, conn: sqlite3.Connection, exc: Exception) -> StoreUnavailable:
        with contextlib.suppress(sqlite3.Error):
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        self._db.note_corrupt(exc)
        if isinstance(exc, StoreUnavailable):  # the file is gone or corrupt: said as it is
            error = exc
        else:
            error = StoreUnavailable(f"sqlite write to {self._db.path} failed: {exc}")
            error.__cause__ = exc
        self._db.write_failed(str(error))
        return error


def run_alone(conn: sqlite3.Connection, batch: Batch, op: Any) -> tuple[Any, TidepoolError | None]:
    """One plain op inside a savepoint: whatever it raises fails this op only, not the transaction."""
    conn.execute("SAVEPOINT op")
    moves = len(batch.moves)
    try:
        result = op(conn, batch)
    except Exception as exc:
        if error_code(exc) in FILE_FAULTS or not conn.in_transaction:  # not this op's fault: the batch fails
            raise
        conn.execute("ROLLBACK TO op")
        conn.execute("RELEASE op")
        del batch.moves[moves:]  # what it did to scans is rolled back with it
        batch.queued = None  # the op may have counted itself in before failing: recount
        if isinstance(exc, TidepoolError):  # Conflict, LeaseLost, InvalidTransition, ...
            return None, exc
        log.error("sqlite op failed and was rolled back alone: %r", exc)
        error = StoreUnavailable(f"sqlite write failed: {exc}")
        error.__cause__ = exc
        return None, error
    conn.execute("RELEASE op")
    return result, None


def _groups(ops: list[Queued]) -> list[list[Queued]]:
    """Split a batch into runs: grouped ops of one key together (at most MAX_GROUP), every other op alone.

    The ops of one batch were all in flight at once, so any serial order of them is a valid history:
    gathering claims and completions of the whole batch lets each kind share one statement.
    """
    runs: list[list[Queued]] = []
    open_runs: dict[object, list[Queued]] = {}
    for item in ops:
        op = item[0]
        if not isinstance(op, Grouped):
            runs.append([item])
            continue
        key = op.group_key()
        run = open_runs.get(key)
        if run is None or len(run) >= Grouped.MAX_GROUP:
            run = open_runs[key] = []
            runs.append(run)
        run.append(item)
    return runs


def _drain(ops: queue.SimpleQueue[Any]) -> list[Any]:
    items = []
    while True:
        try:
            items.append(ops.get_nowait())
        except queue.Empty:
            return items


def _settle(outcomes: list[Settled]) -> None:
    for future, result, error in outcomes:
        if future.cancelled():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
