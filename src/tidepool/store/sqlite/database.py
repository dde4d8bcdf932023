"""The SQLite database file: opening it (and only a tidepool file), its schema, and what went wrong with it.

Migrations are the numbered `NNN_*.sql` files beside this module; the schema version SQLite keeps in
`PRAGMA user_version` is the number of the last one run. Every other statement is named in queries.sql.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from pathlib import Path

from ...errors import ConfigError, SchemaMismatch, StoreUnavailable
from .. import sql
from ..rows import SCHEMA_VERSION

log = logging.getLogger("tidepool.store.sqlite")
WRITE_FAILURE_HOLD_S = 30.0  # a failed write transaction makes the node unready this long (see write_failure)
MIGRATIONS = sql.migrations(__package__)
Q = sql.queries(__package__, "queries.sql")  # every statement the store runs, by name
assert MIGRATIONS[-1][0] == SCHEMA_VERSION, "the last migration file is the schema version both stores build"


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
