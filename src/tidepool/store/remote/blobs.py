"""A remote worker's blobs: the inputs it fetches from its gateway into a cache on this host, and the artifacts
it uploads there.

An input comes from GET /w1/blobs/{sha256}, which the gateway answers only while this worker holds a live lease
on a task naming it. It is streamed to a temporary file, and enters the cache (node.state_dir/cache/<sha256>)
only once whole, fsynced and of the sha256 asked for; the cache keeps the most recently used inputs within
[artifacts] cache_mb, and one in use is never evicted under it (0: an input is kept only while it is placed).
Places of one sha256 at once fetch it once. An input is placed as a copy, never a hard link: a plugin can make
a file of its own user writable again, and would change the cache's bytes under every later attempt.

An artifact is hashed first, then streamed from its file with PUT /w1/artifacts/{attempt}/{name}; the gateway
records it once per (attempt, name), so a try sent again after a lost answer is the same record.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio

from ...errors import (
    BlobNotFound,
    BlobTooLarge,
    Conflict,
    DigestMismatch,
    InvalidRequest,
    QuotaExceeded,
    RemoteNode,
    StoreUnavailable,
    ValueRefused,
)
from ...model import SHA256_PATTERN, Artifact, Blob, Lease, file_name_error, new_id
from ..digests import CHUNK, source_chunks
from ..port import ArtifactQuota
from .database import (
    CONNECT_TIMEOUT_S,
    RECONNECT,
    REQUEST_TIMEOUT_S,
    Answer,
    Calls,
    Refusal,
    Wire,
    checked,
    instant,
    parse_json,
    reason,
)
from .leases import GatewayLeases, ended_here

_SHA256 = re.compile(SHA256_PATTERN)
_LIMIT = re.compile(r"at most (\d+) bytes")
_ACTUAL = re.compile(r"sha256 is ([0-9a-f]{64})")


class InputCache:
    """Inputs by sha256 under one directory, least recently used first out past max_bytes. Not configured
    (use() not called), an input is fetched beside the file it becomes and nothing is kept."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.max_bytes = 0
        self._entries: OrderedDict[str, int] = OrderedDict()  # sha256 -> size, least recently used first
        self._pins: Counter[str] = Counter()  # places under way, which keep their entry
        self._locks: dict[str, anyio.Lock] = {}  # one fetch of a sha256 at a time

    def use(self, root: Path, *, max_bytes: int) -> None:
        """Keep inputs under `root` within max_bytes. A new root is read as it is (its entries by their last
        use, which each use saves as the file's mtime) and its tmp/ emptied: a fetch cut short by a crash
        never became an entry."""
        if root != self.root:
            tmp = root / "tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True, mode=0o700)
            found = sorted((p.stat().st_mtime, p.name, p.stat().st_size) for p in root.iterdir()
                            if p.is_file() and _SHA256.match(p.name))
            self._entries = OrderedDict((name, size) for _, name, size in found)
            self.root = root
        self.max_bytes = max_bytes
        self._evict()

    def cached(self) -> list[str]:
        """The sha256 of each input kept, least recently used first."""
        return list(self._entries)

    async def place(self, sha256: str, path: Path, fetch: Callable[[Path], Awaitable[None]]) -> None:
        """Write input `sha256` to the new file `path`: from the cache, or fetch(file) writes its verified bytes
        to a temporary file first."""
        if self.root is None:
            part = path.with_name(f".{path.name}.{new_id()}.part")
            try:
                await fetch(part)
                os.replace(part, path)
            finally:
                part.unlink(missing_ok=True)
            return
        self._pins[sha256] += 1
        try:
            async with self._locks.setdefault(sha256, anyio.Lock()):
                if sha256 not in self._entries:
                    await self._admit(sha256, fetch)
            self._entries.move_to_end(sha256)
            await anyio.to_thread.run_sync(_copy, self.root / sha256, path)
        finally:
            self._pins[sha256] -= 1
            if not self._pins[sha256]:
                del self._pins[sha256]
                self._locks.pop(sha256, None)
            self._evict()

    async def _admit(self, sha256: str, fetch: Callable[[Path], Awaitable[None]]) -> None:
        assert self.root is not None
        part = self.root / "tmp" / f"{sha256}.{new_id()}"
        try:
            await fetch(part)
            size = part.stat().st_size
            os.replace(part, self.root / sha256)
        finally:
            part.unlink(missing_ok=True)
        self._entries[sha256] = size

    def _evict(self) -> None:
        """The least recently used entries out until the rest fit, but those being placed."""
        if self.root is None:
            return
        total = sum(self._entries.values())
        for sha256 in list(self._entries):
            if total <= self.max_bytes:
                break
            if not self._pins[sha256]:
                (self.root / sha256).unlink(missing_ok=True)
                total -= self._entries.pop(sha256)


def _copy(entry: Path, path: Path) -> None:
    shutil.copyfile(entry, path)  # sendfile(2) on Linux: no bytes through Python
    os.utime(entry)  # its last use, which orders the cache again after a restart


class GatewayBlobs:
    """The worker's blob verbs at its gateway, each fenced by a lease that still lasts here."""

    def __init__(self, wire: Wire, calls: Calls, leases: GatewayLeases) -> None:
        self._wire = wire
        self._calls = calls
        self._leases = leases
        self.cache = InputCache()

    async def place_input(self, lease: Lease, sha256: str, path: Path) -> None:
        if not _SHA256.match(sha256):
            raise BlobNotFound(sha256[:64])
        await self.cache.place(sha256, path, lambda part: self._retried(lease, lambda: self._fetch(sha256, part)))

    async def record_artifact(self, lease: Lease, name: str, source: Path | bytes, *, content_type: str | None,
                              quota: ArtifactQuota) -> Artifact:
        """The gateway holds the attempt to its own quotas; `quota` bounds only what is hashed here."""
        if (why := file_name_error(name)) is not None:
            raise InvalidRequest("name", why)
        sha256, size = await anyio.to_thread.run_sync(_digest, source)
        artifact: Artifact = await self._retried(lease, lambda: self._upload(lease, name, source, sha256, size,
                                                                             content_type))
        return artifact

    async def _retried(self, lease: Lease, call: Callable[[], Awaitable[Any]]) -> Any:
        """A call tried again with backoff while the gateway is away, for as long as the lease lasts here."""
        for wait_s in RECONNECT.delays():
            if self._leases.time_left(lease) <= 0:
                raise ended_here(lease)
            try:
                return await call()
            except StoreUnavailable as exc:
                self._calls.failed(exc)
                if wait_s >= self._leases.time_left(lease):
                    raise
            except Refusal as exc:
                raise self._leases.refused(lease, exc) from None
            await anyio.sleep(wait_s)
        raise AssertionError("RECONNECT has no end")

    async def _fetch(self, sha256: str, part: Path) -> None:
        path = f"/w1/blobs/{sha256}"
        digest = hashlib.sha256()
        try:
            async with self._wire.session().get(self._wire.url + path, timeout=_streaming(), ssl=self._wire.tls) as r:
                if r.status != 200:
                    answer = checked(Answer(r.status, parse_json(await r.read())), path, self._wire.url)
                    if answer.status == 403:
                        raise BlobNotFound(sha256)  # the gateway says only that no live lease here names it
                    raise StoreUnavailable(f"gateway {self._wire.url}: unexpected answer {answer.status} to {path}: "
                                           f"{answer.error_message()}")
                async with await anyio.open_file(part, "wb") as out:
                    async for chunk in r.content.iter_chunked(CHUNK):
                        digest.update(chunk)
                        await out.write(chunk)
                    await out.flush()
                    await anyio.to_thread.run_sync(os.fsync, out.wrapped.fileno())  # whole before it is an entry
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise StoreUnavailable(f"gateway {self._wire.url} did not answer {path}: {reason(exc)}") from None
        self._calls.answered()
        if digest.hexdigest() != sha256:
            raise DigestMismatch(sha256, digest.hexdigest(), field=f"input {sha256}")

    async def _upload(self, lease: Lease, name: str, source: Path | bytes, sha256: str, size: int,
                      content_type: str | None) -> Artifact:
        path = f"/w1/artifacts/{lease.attempt_id}/{name}"
        headers = {"X-Lease-Token": lease.token, "X-Content-SHA256": sha256, "Content-Length": str(size),
                   **({"Content-Type": content_type} if content_type else {})}
        try:
            # closed however the call ends: the gateway may answer (a lost lease, a quota) before it is all read
            async with contextlib.aclosing(source_chunks(source)) as body, self._wire.session().put(
                    self._wire.url + path, data=body, headers=headers, ssl=self._wire.tls, timeout=_streaming(),
                    skip_auto_headers=("Content-Type",)) as r:
                answer = checked(Answer(r.status, parse_json(await r.read())), path, self._wire.url)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise StoreUnavailable(f"gateway {self._wire.url} did not answer {path}: {reason(exc)}") from None
        self._calls.answered()
        return self._artifact_of(lease, answer, sha256)

    def _artifact_of(self, lease: Lease, answer: Answer, sha256: str) -> Artifact:
        code, message = answer.error_code(), answer.error_message()
        if answer.status in (200, 201):
            with self._calls.reading("/w1/artifacts"):
                data = answer.body
                return Artifact(data["name"], data["sha256"], int(data["size"]), data.get("content_type"),
                                data["attempt_id"], instant(data["created_at"]))
        if answer.status == 410:
            raise self._leases.lost(lease, answer)
        if answer.status == 409:
            raise Conflict(f"task {lease.task_id} attempt {lease.attempt_id}: {message}")
        if answer.status == 413 and code == BlobTooLarge.code:
            raise BlobTooLarge(int(m.group(1)) if (m := _LIMIT.search(message)) else 0)
        if answer.status == 413:
            raise QuotaExceeded(code or "artifact_quota", message)
        if code == DigestMismatch.code:  # the file changed after it was hashed
            raise DigestMismatch(sha256, m.group(1) if (m := _ACTUAL.search(message)) else "another")
        if answer.status in (400, 422):
            raise ValueRefused(f"gateway {self._wire.url} refused artifact of attempt {lease.attempt_id} "
                               f"({answer.status} {code}): {message}")
        raise StoreUnavailable(f"gateway {self._wire.url}: unexpected answer {answer.status} to an artifact: {message}")


def _streaming() -> aiohttp.ClientTimeout:
    """A transfer may take long in all, but never stands still for REQUEST_TIMEOUT_S."""
    return aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=REQUEST_TIMEOUT_S)


def _digest(source: Path | bytes) -> tuple[str, int]:
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest(), len(source)
    digest, size = hashlib.sha256(), 0
    with source.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


# the queue's blob verbs: the blobs are the gateway's, so each refuses here as the queue's other verbs do


async def put_blob(gateway_url: str) -> tuple[Blob, bool]:
    raise RemoteNode(gateway_url)


async def get_blob(gateway_url: str) -> Blob:
    raise RemoteNode(gateway_url)


async def read_blob(gateway_url: str) -> AsyncIterator[bytes]:
    raise RemoteNode(gateway_url)
    yield b""  # an async generator, as the port's read_blob: it refuses at its first chunk


async def list_artifacts(gateway_url: str) -> list[Artifact]:
    raise RemoteNode(gateway_url)


async def note_artifact(gateway_url: str) -> Artifact:
    raise RemoteNode(gateway_url)


async def leased_blob(gateway_url: str) -> bool:
    raise RemoteNode(gateway_url)


async def prune_blobs(gateway_url: str) -> int:
    raise RemoteNode(gateway_url)
