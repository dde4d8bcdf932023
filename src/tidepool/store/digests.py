"""A blob's digest as its bytes stream past (SHA-256 and size, bounded), and the streams themselves: a source
read, or a body re-cut, in chunks of at most 1 MiB, so that no adapter ever holds a whole blob."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from pathlib import Path
from typing import BinaryIO

import anyio

from ..errors import BlobTooLarge, DigestMismatch

CHUNK = 1 << 20  # the most bytes of one blob any read, write or row holds at once


class Digest:
    """The SHA-256 and size of the bytes seen so far; BlobTooLarge as soon as they pass `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self._hash = hashlib.sha256()
        self._max_bytes = max_bytes
        self.size = 0

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self._max_bytes:
            raise BlobTooLarge(self._max_bytes)
        self._hash.update(chunk)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def check(self, expect: str | None) -> None:
        """DigestMismatch when the sender named another sha256 than the bytes have."""
        if expect is not None and expect != self.sha256:
            raise DigestMismatch(expect, self.sha256)


async def rechunked(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The same bytes in chunks of exactly CHUNK (the last one shorter): a body's small pieces joined, its big
    ones cut, so a store writes few rows or calls and never one past CHUNK."""
    buffer = bytearray()
    async for chunk in chunks:
        buffer += chunk
        while len(buffer) >= CHUNK:
            yield bytes(buffer[:CHUNK])
            del buffer[:CHUNK]
    if buffer:
        yield bytes(buffer)


async def source_chunks(source: Path | bytes) -> AsyncGenerator[bytes, None]:
    """An artifact's bytes: a file read in chunks (each read in a thread: the disk may be slow), or bytes cut."""
    if isinstance(source, bytes):
        for at in range(0, len(source), CHUNK):
            yield source[at:at + CHUNK]
        return
    file: BinaryIO = await anyio.to_thread.run_sync(source.open, "rb")
    try:
        while chunk := await anyio.to_thread.run_sync(file.read, CHUNK):
            yield chunk
    finally:
        file.close()


def source_size(source: Path | bytes) -> int:
    """How many bytes an artifact's source holds now (a file's may still change; its stream is what counts)."""
    return len(source) if isinstance(source, bytes) else source.stat().st_size


async def write_new(path: Path, chunks: AsyncIterable[bytes]) -> None:
    """Write the chunks to the new file `path` (FileExistsError if it exists), each write in a thread."""
    file: BinaryIO = await anyio.to_thread.run_sync(path.open, "xb")
    try:
        async for chunk in chunks:
            await anyio.to_thread.run_sync(file.write, chunk)
    finally:
        file.close()
