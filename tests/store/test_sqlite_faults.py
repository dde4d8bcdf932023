"""The SQLite adapter under a failing file: a full disk and a corrupt file are said by write_failure()
(the node's readiness), a full disk for WRITE_FAILURE_HOLD_S after its last failed write."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path

import anyio
import pytest

from tidepool.errors import StoreUnavailable
from tidepool.model import NewTask
from tidepool.store.sqlite import SqliteStore
from tidepool.store.sqlite import database as sqlite_database


async def test_a_full_disk_fails_writes_naming_the_file_and_is_said_a_while_after_its_last_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite_database, "WRITE_FAILURE_HOLD_S", 0.5)
    store = SqliteStore(tmp_path / "tidepool.db")
    await store.open()
    try:
        await store.add(NewTask("noop"), now=time.time())
        pages = await store._write(lambda conn, batch: conn.execute("PRAGMA page_count").fetchone()[0])
        # SQLite's own "disk full": the file may not grow past the pages it has
        await store._write(lambda conn, batch: conn.execute(f"PRAGMA max_page_count = {pages}"))
        big = [NewTask("noop", {"blob": "x" * 4000}) for _ in range(50)]
        with pytest.raises(StoreUnavailable, match=rf"{tmp_path}.*full"):
            await store.add_many(big, now=time.time())
        failure = await store.write_failure()
        assert failure is not None and "full" in failure
        assert (await store.counts())  # reads still answer: the probes must not take that for health
        (task,) = (await store.list_tasks()).tasks
        await store.request_cancel(task.id, now=time.time())  # an update in place still commits on a full disk
        assert await store.write_failure() is not None, "an update in place proves nothing of an insert"
        await store._write(lambda conn, batch: conn.execute(f"PRAGMA max_page_count = {pages * 100}"))
        await store.add_many(big, now=time.time())
        await anyio.sleep(0.6)
        assert await store.write_failure() is None
    finally:
        await store.close()


async def test_a_corrupt_file_stops_writes_for_good_and_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "tidepool.db"
    store = SqliteStore(path)
    await store.open()
    await store.add_many([NewTask("noop", {"n": n, "pad": "p" * 500}) for n in range(2000)], now=time.time())
    await store.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        schema_pages = conn.execute("SELECT max(rootpage) FROM sqlite_master").fetchone()[0]  # made first, empty
    data = bytearray(path.read_bytes())
    end = schema_pages * page_size
    data[end:] = b"\xa5" * (len(data) - end)  # every page past the schema's is garbage
    path.write_bytes(bytes(data))

    store = SqliteStore(path)
    await store.open()
    try:
        with pytest.raises(StoreUnavailable, match="malformed"):
            await store.list_tasks(limit=1000)
        failure = await store.write_failure()
        assert failure is not None and "corrupt" in failure and "integrity_check" in failure
        with pytest.raises(StoreUnavailable, match="corrupt"):
            await store.add(NewTask("noop"), now=time.time())
    finally:
        await store.close()
