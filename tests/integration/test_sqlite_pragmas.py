"""The SQLite store's connections run with what the documentation promises: WAL mode and synchronous=FULL, so
a task acknowledged is committed and synced before its answer goes out.

synchronous is a setting of each connection, invisible from outside the process: the connections are
the store's own, found as Python opens them (the `sqlite3.connect/handle` audit event), and asked.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tidepool.model import NewTask
from tidepool.store.sqlite import SqliteStore

FULL = 2  # PRAGMA synchronous: 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA
_opened: list[sqlite3.Connection] | None = None  # set while a test collects connections


def _collect(event: str, args: tuple[Any, ...]) -> None:
    if event == "sqlite3.connect/handle" and _opened is not None:
        _opened.append(args[0])


sys.addaudithook(_collect)  # an audit hook stays for the process' life: it only collects inside opened()


@contextlib.contextmanager
def opened() -> Iterator[list[sqlite3.Connection]]:
    """Every sqlite3 connection this process opens meanwhile."""
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def pragmas(connections: list[sqlite3.Connection]) -> list[tuple[str, int]]:
    """(journal_mode, synchronous) of each connection still open."""
    found = []
    for conn in connections:
        with contextlib.suppress(sqlite3.ProgrammingError):  # closed already (a check before the open)
            found.append((conn.execute("PRAGMA journal_mode").fetchone()[0],
                          conn.execute("PRAGMA synchronous").fetchone()[0]))
    return found


async def test_every_connection_of_the_store_is_in_wal_mode_with_synchronous_full(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "tidepool.db")
    with opened() as connections:
        await store.open()
        try:
            task, _ = await store.add(NewTask("noop"), now=time.time())  # the writer, then readers
            assert (await store.get(task.id)).id == task.id
            assert (await store.list_tasks()).tasks and await store.counts()
            in_force = pragmas(connections)
        finally:
            await store.close()
    assert in_force, "the store opened no connection this process saw"
    assert in_force == [("wal", FULL)] * len(in_force), in_force
