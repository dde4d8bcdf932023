"""The SQLite database file and its plumbing: opening it (only a tidepool file), its schema and migrations, its
health, the one writer thread with its group commit, and the reads on the reader connection.

Migrations are the numbered `NNN_*.sql` files in sql/; the schema version SQLite keeps in `PRAGMA user_version`
is the number of the last one run. Every other statement is named in the .sql file of the module that runs it.

Every write is an op queued to one thread that owns the only writing connection. The thread takes whatever ops
have queued up and runs them in one transaction, so many workers share each fsync (here ~4k single-step
transactions/s, ~45k steps/s grouped). Each plain op runs inside its own savepoint, so an op that raises
(LeaseLost, Conflict, or a SQLite error) fails alone and the others of its transaction stand; claims and
completions of a batch are gathered into shared statements (Grouped). Only a failing transaction as a whole
fails every op with StoreUnavailable. Reads run on a second connection, beside the writer's transactions (WAL).

One piece, as these are sides of the one file's health: the writer asks before every transaction whether the
file is still the one opened and sound, both connections note what SQLite said went wrong with it, and
write_failure reports what they noted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import anyio.to_thread

from ...errors import ConfigError, SchemaMismatch, StoreUnavailable, TidepoolError, ValueRefused
from ...model import Attempt, Task
from .. import sql
from ..rows import SCHEMA_VERSION, loads
from ..rows import task_of as row_task

log = logging.getLogger("tidepool.store.sqlite")
WRITE_FAILURE_HOLD_S = 30.0  # a failed write transaction makes the node unready this long (see write_failure)
MIGRATIONS = sql.migrations(__package__)
assert MIGRATIONS[-1][0] == SCHEMA_VERSION, "the last migration file is the schema version both stores build"
GROUP_PAUSE_S = 0.0005  # under load, how long the writer waits for more ops to share a transaction
GROUP_PAUSE_FROM = 8  # ops in this batch and the last before a pause can pay for itself (see _loop_on)
# What the file did, not the op: SQLite may have rolled the whole transaction back already.
FILE_FAULTS = frozenset({sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB,
                         sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_NOMEM})
# What binding a value raises when SQLite cannot keep it: text that is not UTF-8 (a lone surrogate), an integer
# past 64 bits, a string or blob past its limits. Written again it would be refused again: never an outage.
VALUE_ERRORS: tuple[type[BaseException], ...] = (UnicodeError, OverflowError, sqlite3.DataError)
CHUNK = 500  # rows per statement: 7 parameters each at most, far below SQLite's 32,766
T = TypeVar("T")

# the file


class Database:
    """One database file, and what is known about its health."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.corrupt: str | None = None  # once SQLite says the file is malformed, for good
        self._inode: tuple[int, int] | None = None  # (device, inode) of the file opened: see still_ours
        self._wal_inode: tuple[int, int] | None = None  # and of its write-ahead log, once it exists
        # The two names as plain strings, made once: still_ours() runs before every write transaction, and
        # a Path's with_name() and str() there cost more than the two stat() calls themselves.
        self._names = (str(path), str(path.with_name(path.name + "-wal")))
        self._write_failed: tuple[str, float] | None = None  # why a write transaction failed, and when

    def connect_writer(self, migrate: bool) -> tuple[sqlite3.Connection, int]:
        """The writer's connection, the schema brought to SCHEMA_VERSION (when `migrate`), and the version it had."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            try:  # before anything is written, the journal mode included
                version = self._check_ours(conn)
                _check_version(self.path, version, migrate)
            except (ConfigError, SchemaMismatch):
                conn.close()
                raise
            stat = os.stat(self.path)
            self._inode = (stat.st_dev, stat.st_ino)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")  # an acknowledged commit survives power loss
            conn.execute("PRAGMA busy_timeout=5000")
            _migrate(conn, version)
            return conn, version
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"store {self.path}: {exc}") from exc

    def connect_reader(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout=5000")
        return conn

    def read(self, conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` run on the reader connection `conn` (in a worker thread): what SQLite raises is StoreUnavailable."""
        try:
            return fn(conn)
        except sqlite3.Error as exc:
            self.note_corrupt(exc)
            raise StoreUnavailable(f"sqlite read of {self.path} failed: {exc}") from exc

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

    def still_ours(self) -> None:
        """The file opened, and its write-ahead log, are still the database's names. Deleted or replaced while
        open, SQLite would go on writing to a file no name reaches: every task acknowledged from then on would
        be gone at restart (the log holds every commit since the last checkpoint)."""
        path, wal = self._names
        for name, opened in ((path, self._inode), (wal, self._wal_inode)):
            if opened is not None and _inode(name) != opened:
                raise StoreUnavailable(f"the database file {name} was deleted or replaced while open; nothing more "
                                       "is written: restart the node (what it held since is lost with the file)")
        if self._wal_inode is None:  # made by the first write; kept while we are open
            self._wal_inode = _inode(wal)

    def write_failed(self, why: str) -> None:
        self._write_failed = (why, time.monotonic())

    def write_failure(self) -> str | None:
        """Why writes fail (the file is corrupt or gone, or a write transaction failed in the last
        WRITE_FAILURE_HOLD_S), else None. A write that gets through does not clear it: on a full disk a
        heartbeat's update in place commits while every insert fails."""
        if self.corrupt:
            return self.corrupt
        if self._write_failed is not None and time.monotonic() - self._write_failed[1] < WRITE_FAILURE_HOLD_S:
            return self._write_failed[0]
        return None

    def note_corrupt(self, exc: BaseException) -> None:
        if self.corrupt is None and error_code(exc) in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
            self.corrupt = (f"the database {self.path} is corrupt ({exc}): writes stop; check it with PRAGMA "
                            "integrity_check and restore it from a backup")
            log.error("%s", self.corrupt)


def error_code(exc: BaseException) -> int | None:
    """SQLite's primary result code of an sqlite3 error (its extended code's low byte), else None."""
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def _check_version(path: Path, version: int, migrate: bool) -> None:
    if version > SCHEMA_VERSION or (version < SCHEMA_VERSION and not migrate):
        raise SchemaMismatch(f"store {path} has schema version {version}, " + (
            f"newer than this tidepool understands ({SCHEMA_VERSION}): upgrade tidepool"
            if version > SCHEMA_VERSION else f"needs {SCHEMA_VERSION}: run `tidepool migrate`"))


def _migrate(conn: sqlite3.Connection, version: int) -> None:
    """Run the migrations past `version`, all in one transaction."""
    steps = [text for number, text in MIGRATIONS if number > version]
    if steps:
        conn.executescript(f"BEGIN; {' '.join(steps)}; PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")


def _inode(path: Path | str) -> tuple[int, int] | None:
    with contextlib.suppress(FileNotFoundError):
        stat = os.stat(path)
        return stat.st_dev, stat.st_ino
    return None


# the writer


@dataclass
class Batch:
    """Facts shared by the ops of one transaction."""

    queued: int | None = None  # the queue's length as its ops left it, once counted (tasks.queued); None: count again
    moves: list[Any] = field(default_factory=list)  # the scans' moves (ScanMove) its ops made, told after commit


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
        if isinstance(exc, VALUE_ERRORS):
            refused = ValueRefused(f"sqlite refused a value: {type(exc).__name__}: {exc}")
            refused.__cause__ = exc
            return None, refused
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


# what the modules of the store share: statements built per call, and the rows of tasks


def marks(n: int) -> str:
    return ",".join("?" * n)


def chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[i:i + CHUNK] for i in range(0, len(items), CHUNK)]


def task_of(row: Any, *, attempts: tuple[Attempt, ...] = (), leased_by: str | None = None,
            now: float | None = None) -> Task:
    """A Task from a TASK_COLUMNS row (its tags are JSON text); with leased_by, as it reads once this claim
    commits."""
    return row_task(row, required_tags=loads(row[11]), attempts=attempts, leased_by=leased_by, now=now)
