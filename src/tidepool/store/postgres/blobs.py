"""Blobs and artifacts in the PostgreSQL store: the blobs' rows, their bytes as chunks of at most 1 MiB
(blob_chunks; with [artifacts] store = "file", files of one node instead: blobfiles.py), and the artifacts.

An upload streams at its sender's pace, so its chunks go in on a connection of its own, outside the pool
(a pooled one held that long would starve the queue's calls; at most UPLOADS_AT_ONCE of them), in one
transaction with the blob's row: the blob is visible only whole. Its chunks are written under a name of
their own ('partial:...') and renamed to the sha256 once it is known. A task's inputs are written with its
row (tasks.py), a scan's with its own (scans.py); both hold the blobs they name (FOR KEY SHARE), which the pruning
skips.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterable, AsyncIterator

import asyncpg  # type: ignore[import-untyped, unused-ignore]  # typed when asyncpg-stubs is installed

from ...errors import BlobNotFound, LeaseLost, StoreUnavailable, TaskNotFound
from ...model import Artifact, Blob, Lease
from .. import sql
from ..bounds import check_artifact_quota
from ..digests import CHUNK, Digest, rechunked
from ..port import ArtifactQuota
from ..rows import artifact_of
from ..rules import artifact_taken, check_artifact_name
from .database import DRIVER_ERRORS, Conn, Database, said
from .leases import why_lost

SQL = sql.queries(__package__, "blobs.sql")


async def put_chunks(db: Database, chunks: AsyncIterable[bytes], *, now: float, max_bytes: int,
                     expect: str | None) -> tuple[Blob, bool]:
    async with db.uploads:
        return await _put_chunks(db, chunks, now=now, max_bytes=max_bytes, expect=expect)


async def _put_chunks(db: Database, chunks: AsyncIterable[bytes], *, now: float, max_bytes: int,
                      expect: str | None) -> tuple[Blob, bool]:
    digest, partial = Digest(max_bytes), f"partial:{uuid.uuid4().hex}"
    conn = await db.connect("blob upload")
    try:
        async with conn.transaction():
            seq = 0
            async for chunk in rechunked(chunks):
                digest.update(chunk)
                await conn.execute(SQL["insert_chunk"], partial, seq, chunk)
                seq += 1
            digest.check(expect)
            blob, created = await _row(conn, digest, now)
            if created:
                await conn.execute(SQL["name_chunks"], partial, blob.sha256)
            else:
                await conn.execute(SQL["drop_chunks"], partial)
            return blob, created
    except DRIVER_ERRORS as exc:
        raise StoreUnavailable(f"store {db.where}: an upload failed: {said(exc)}") from exc
    finally:
        await conn.close()


async def put_row(db: Database, digest: Digest, *, now: float) -> tuple[Blob, bool]:
    """The row of a blob whose bytes are a file, once it is in place."""
    async with db.conn() as conn:
        return await _row(conn, digest, now)


async def _row(conn: Conn, digest: Digest, now: float) -> tuple[Blob, bool]:
    row = await conn.fetchrow(SQL["put_blob"], digest.sha256, digest.size, now)
    return Blob(row[0], row[1], row[2]), bool(row[3])


async def get_blob(db: Database, sha256: str) -> Blob:
    async with db.conn() as conn:
        row = await conn.fetchrow(SQL["blob"], sha256)
    if row is None:
        raise BlobNotFound(sha256)
    return Blob(row[0], row[1], row[2])


async def read_chunks(db: Database, blob: Blob, *, start: int, stop: int | None) -> AsyncIterator[bytes]:
    """The bytes [start, stop), a chunk per call (a reader as slow as it likes holds no connection)."""
    stop = blob.size if stop is None else min(stop, blob.size)
    at = max(start, 0)
    while at < stop:
        seq, offset = divmod(at, CHUNK)
        async with db.conn() as conn:
            data = await conn.fetchval(SQL["chunk"], blob.sha256, seq, offset + 1, min(CHUNK - offset, stop - at))
        if not data:  # pruned while it was read
            raise BlobNotFound(blob.sha256)
        at += len(data)
        yield bytes(data)


async def list_artifacts(db: Database, task_id: str) -> list[Artifact]:
    async with db.conn() as conn:
        if not await conn.fetchval(SQL["task_exists"], task_id):
            raise TaskNotFound(task_id)
        return [artifact_of(r) for r in await conn.fetch(SQL["artifacts_of_task"], task_id)]


async def note_artifact(db: Database, lease: Lease, name: str, blob: Blob, *, content_type: str | None, now: float,
                        quota: ArtifactQuota, identity: str | None) -> Artifact:
    async with db.conn() as conn, conn.transaction():
        earlier = await admit(conn, lease, name, blob.sha256, blob.size, now=now, quota=quota, identity=identity)
        if earlier is not None:
            return earlier
        if await conn.fetchval(SQL["hold_blob"], blob.sha256) is None:
            raise BlobNotFound(blob.sha256)
        await conn.execute(SQL["insert_artifact"], lease.attempt_id, lease.task_id, name, blob.sha256, blob.size,
                           content_type, now)
    return Artifact(name, blob.sha256, blob.size, content_type, lease.attempt_id, now)


async def check_artifact(db: Database, lease: Lease, name: str, size: int, *, now: float,
                         quota: ArtifactQuota) -> None:
    """note_artifact's checks before the bytes are stored, so a refused artifact leaves no blob either."""
    async with db.conn() as conn, conn.transaction():
        await admit(conn, lease, name, None, size, now=now, quota=quota)


async def admit(conn: Conn, lease: Lease, name: str, sha256: str | None, size: int, *, now: float,
                quota: ArtifactQuota, identity: str | None = None) -> Artifact | None:
    """The attempt's earlier artifact of this name, or None when a new one may be recorded; the fence, the
    idempotence and the quota refuse it otherwise (without `sha256`, an earlier one is not judged)."""
    check_artifact_name(name)
    holder = await conn.fetchrow(SQL["holder"], lease.task_id, lease.attempt_id, lease.token, now)
    if holder is None:
        raise await why_lost(conn, lease, now)
    if identity is not None and holder[1] != identity:
        raise LeaseLost(lease.task_id, lease.attempt_id)
    earlier = await conn.fetchrow(SQL["artifact_by_name"], lease.attempt_id, name)
    if earlier is not None:
        if sha256 is not None and earlier[1] != sha256:
            raise artifact_taken(lease, name, earlier[1])
        return artifact_of(earlier)
    count, stored = await conn.fetchrow(SQL["artifact_counts"], lease.attempt_id)
    check_artifact_quota(quota, task_id=lease.task_id, attempt_id=lease.attempt_id, count=count,
                         stored_bytes=stored, adding=size)
    return None


async def check_input(db: Database, lease: Lease, sha256: str) -> None:
    """LeaseLost behind a stale token, BlobNotFound for a blob the leased task does not name."""
    async with db.conn() as conn:
        held, named = await conn.fetchrow(SQL["held"], lease.task_id, lease.attempt_id, lease.token, sha256)
    if not held:
        raise LeaseLost(lease.task_id, lease.attempt_id)
    if not named:
        raise BlobNotFound(sha256)


async def leased_blob(db: Database, identity: str, sha256: str, *, now: float) -> bool:
    async with db.conn() as conn:
        return bool(await conn.fetchval(SQL["leased_blob"], sha256, identity, now))


async def prune_blobs(db: Database, *, before: float) -> list[str]:
    """Delete the old blobs nothing names (their chunks with them); their sha256s. A pass that a submit's
    commit beside it refused deletes nothing: the next one judges those blobs anew."""
    try:
        async with db.conn() as conn:
            return [r[0] for r in await conn.fetch(SQL["prune_blobs"], before)]
    except StoreUnavailable as exc:
        if isinstance(exc.__cause__, asyncpg.ForeignKeyViolationError):
            return []
        raise
