"""Where a store keeps blobs' bytes: files beside a SQLite database (never a partial one), chunks in PostgreSQL or
files of one node ([artifacts] store = "file"), and a pruning that skips the blobs a submit in flight holds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import asyncpg
import pytest

from tidepool.errors import BlobTooLarge, ConfigError, DigestMismatch
from tidepool.settings import ArtifactSettings
from tidepool.store import Store, open_store
from tidepool.store.digests import CHUNK
from tidepool.store.postgres import PostgresStore
from tidepool.store.postgres.database import UPLOADS_AT_ONCE
from tidepool.store.sqlite import SqliteStore

from .conftest import T0
from .test_blobs import BIG, put, sha


@pytest.mark.parametrize("kind", ["sqlite"])
async def test_sqlite_keeps_a_blobs_bytes_in_one_file_and_no_partial_one(store: Store) -> None:
    assert isinstance(store, SqliteStore)
    blob = await put(store, BIG)
    path = store.blob_dir / blob.sha256[:2] / blob.sha256
    assert path.read_bytes() == BIG
    with pytest.raises(DigestMismatch):
        await put(store, b"refused", expect=sha(b"other"))
    with pytest.raises(BlobTooLarge):
        await put(store, BIG, max_bytes=CHUNK)
    assert list((store.blob_dir / "tmp").iterdir()) == []
    assert await store.prune_blobs(before=T0 + 1, now=T0 + 1) == 1
    assert not path.exists()


@pytest.mark.parametrize("kind", ["sqlite"])
async def test_sqlite_removes_what_a_crash_left_half_written_at_open(adapter: Store) -> None:
    assert isinstance(adapter, SqliteStore)
    (adapter.blob_dir / "tmp").mkdir(parents=True)
    (adapter.blob_dir / "tmp" / "partial").write_bytes(b"half of an upload")
    await adapter.open()
    try:
        assert list((adapter.blob_dir / "tmp").iterdir()) == []
    finally:
        await adapter.close()


def test_a_sqlite_queue_cannot_keep_its_blobs_in_postgresql(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"artifacts\.store"):
        open_store(f"sqlite:///{tmp_path}/tidepool.db", artifacts=ArtifactSettings(store="postgres"))
    store = open_store(f"sqlite:///{tmp_path}/tidepool.db", blob_dir=tmp_path / "state" / "blobs")
    assert isinstance(store, SqliteStore) and store.blob_dir == tmp_path / "state" / "blobs"


async def test_postgresql_with_store_file_keeps_the_bytes_in_files_and_the_rows_in_the_database(
        tmp_path: Path, postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    store = open_store(url, artifacts=ArtifactSettings(store="file"), blob_dir=tmp_path / "blobs")
    assert isinstance(store, PostgresStore)
    store = PostgresStore(url, schema=schema, blob_dir=tmp_path / "blobs")
    await store.open()
    try:
        blob = await put(store, BIG)
        assert (tmp_path / "blobs" / blob.sha256[:2] / blob.sha256).read_bytes() == BIG
        assert b"".join([c async for c in store.read_blob(blob.sha256, start=5, stop=CHUNK + 7)]) == BIG[5:CHUNK + 7]
        assert await store.prune_blobs(before=T0 + 1, now=T0 + 1) == 1
        assert not (tmp_path / "blobs" / blob.sha256[:2] / blob.sha256).exists()
    finally:
        await store.close()


async def test_postgresql_prune_skips_a_blob_a_submit_in_flight_holds(postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    store = PostgresStore(url, schema=schema)
    await store.open()
    try:
        blob = await put(store, b"sample")
        submit = await asyncpg.connect(url)
        try:
            async with submit.transaction():
                await submit.fetch(f'SELECT sha256 FROM "{schema}".blobs WHERE sha256 = $1 FOR KEY SHARE',
                                   blob.sha256)
                assert await store.prune_blobs(before=T0 + 1, now=T0 + 1) == 0
        finally:
            await submit.close()
        assert await store.get_blob(blob.sha256) == blob
    finally:
        await store.close()


async def test_postgresql_uploads_at_once_hold_at_most_their_share_of_the_servers_connections(
        postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    store = PostgresStore(url, schema=schema)
    await store.open()
    release = anyio.Event()
    started = 0

    async def slow(n: int) -> AsyncIterator[bytes]:
        nonlocal started
        started += 1
        yield b"first %d" % n
        await release.wait()
        yield b" and last"

    async def upload(n: int) -> None:
        await store.put_blob(slow(n), now=T0, max_bytes=CHUNK)

    try:
        async with anyio.create_task_group() as tg:
            for n in range(UPLOADS_AT_ONCE + 4):
                tg.start_soon(upload, n)
            with anyio.fail_after(10):
                while started < UPLOADS_AT_ONCE:
                    await anyio.sleep(0.02)
            await anyio.sleep(0.2)  # a ninth would have started by now
            held = await count_upload_connections(url, schema)
            assert started == UPLOADS_AT_ONCE and held == UPLOADS_AT_ONCE
            release.set()
        for n in range(UPLOADS_AT_ONCE + 4):
            assert (await store.get_blob(sha(b"first %d and last" % n))).size == len(b"first %d and last" % n)
    finally:
        await store.close()


async def count_upload_connections(url: str, schema: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                                       f"tidepool {schema} blob upload"))
    finally:
        await conn.close()
