"""A directory of blob files: `<root>/<aa>/<sha256>`, each written whole to `<root>/tmp/`, fsynced and renamed
into place, so a blob's file exists only complete and durable; whatever a crash left in tmp/ is removed at open.

The records of the blobs live in the queue's database, written by the store through `put` and `prune`: the
file goes in place before its record is written, and the records go before their files. One lock is held
around both steps of each, so that a pruning that deletes a blob cannot unlink the file a put of the same
bytes has just renamed into place (one process owns a directory: a node's lock keeps a second daemon of its
id away).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import anyio
import anyio.to_thread

from ..errors import BlobNotFound, StoreUnavailable
from .digests import CHUNK, Digest

log = logging.getLogger("tidepool.store")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Staged:
    """Bytes written whole and fsynced under tmp/, not yet a blob."""

    path: Path
    digest: Digest


class BlobFiles:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = anyio.Lock()
        self._tmp = root / "tmp"

    async def open(self) -> None:
        await anyio.to_thread.run_sync(self._open)

    async def _stage(self, chunks: AsyncIterable[bytes], *, max_bytes: int, expect: str | None) -> Staged:
        """Write the bytes to a new file under tmp/ (each write in a thread), fsynced; removed again if anything
        fails: BlobTooLarge past max_bytes, DigestMismatch when their sha256 is not `expect`."""
        digest, path = Digest(max_bytes), self._tmp / uuid.uuid4().hex
        try:
            file: BinaryIO = await anyio.to_thread.run_sync(path.open, "xb")
        except OSError as exc:
            raise StoreUnavailable(f"blob directory {self.root}: {exc}") from exc
        try:
            async for chunk in chunks:
                digest.update(chunk)
                await anyio.to_thread.run_sync(file.write, chunk)
            digest.check(expect)
            await anyio.to_thread.run_sync(_flush, file)
        except BaseException:
            file.close()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_unlink, path)
            raise
        file.close()
        return Staged(path, digest)

    async def put(self, chunks: AsyncIterable[bytes], *, max_bytes: int, expect: str | None,
                  record: Callable[[Digest], Awaitable[R]]) -> R:
        """Stage the bytes, rename them into place as their blob's file (a file there already holds the same
        bytes, complete, and stays), then `record(digest)` writes the blob's record: what it answers."""
        staged = await self._stage(chunks, max_bytes=max_bytes, expect=expect)
        async with self._lock:
            await anyio.to_thread.run_sync(self._place, staged)
            return await record(staged.digest)

    async def prune(self, delete_records: Callable[[], Awaitable[list[str]]]) -> int:
        """`delete_records()` deletes the records of the blobs to go and names them; their files go next. How
        many went."""
        async with self._lock:
            gone = await delete_records()
            await anyio.to_thread.run_sync(self._delete, gone)
        return len(gone)

    async def read(self, sha256: str, *, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        """The file's bytes [start, stop), each chunk of at most CHUNK read in a thread; BlobNotFound without it."""
        try:
            file: BinaryIO = await anyio.to_thread.run_sync(self.path(sha256).open, "rb")
        except FileNotFoundError:
            raise BlobNotFound(sha256) from None
        try:
            await anyio.to_thread.run_sync(file.seek, start)
            left = None if stop is None else max(stop - start, 0)
            while left is None or left > 0:
                chunk = await anyio.to_thread.run_sync(file.read, CHUNK if left is None else min(CHUNK, left))
                if not chunk:
                    return
                if left is not None:
                    left -= len(chunk)
                yield chunk
        finally:
            file.close()

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    def _open(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            shutil.rmtree(self._tmp, ignore_errors=True)  # a crash's partial uploads: never blobs
            self._tmp.mkdir(mode=0o700)
        except OSError as exc:  # the queue serves on without files (a read-only disk, say): each put says so
            log.warning("blob directory %s cannot be prepared (%s): blobs cannot be stored", self.root, exc)

    def _place(self, staged: Staged) -> None:
        final = self.path(staged.digest.sha256)
        if final.exists():
            _unlink(staged.path)
            return
        if not final.parent.exists():
            final.parent.mkdir(mode=0o700)
            _fsync_dir(self.root)
        os.replace(staged.path, final)
        _fsync_dir(final.parent)  # the rename itself survives a power loss

    def _delete(self, sha256s: list[str]) -> None:
        for sha256 in sha256s:
            _unlink(self.path(sha256))


def _flush(file: BinaryIO) -> None:
    file.flush()
    os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
