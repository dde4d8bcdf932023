"""Files over the gateway: a blob's bytes for the worker that holds a live lease on a task naming it, and the
artifacts an attempt uploads, fenced before a byte of their body is read.

A blob is answered only to a caller whose live lease names it, and every other caller gets the one same 403
whether the blob exists or not, so a worker learns nothing of the blobs of tasks that are not its own. An
upload is fenced twice: before its body is read, by renewing the lease the caller names (the holder's own
right, what its lease keeper sends anyway; a caller that holds no such lease is answered 410 at once, not
after a gigabyte), and again by the store's write that records it. Its bytes are stored, and their digest
checked, before anything is recorded; a blob stored for a write that is then refused is no task's, and the
reconciler's pruning takes it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterable

from ..errors import BlobNotFound, BlobTooLarge, LeaseGone, LeaseLost, QuotaExceeded
from ..http.refusals import Refusal
from ..model import SHA256_PATTERN, Artifact, Blob, Lease, RemoteWorker
from ..store.bounds import check_artifact_quota
from ..store.port import ArtifactQuota
from .attempts import lease_of
from .protocol import Gateway
from .schemas import LeaseIn

log = logging.getLogger("tidepool.gateway")
NOT_LEASED = "blob_not_leased"
_SHA256 = re.compile(SHA256_PATTERN)


def not_leased(sha256: str) -> Refusal:
    return Refusal(403, NOT_LEASED, f"blob {sha256[:64]}: no live lease of this worker names it as an input")


async def leased_blob(gateway: Gateway, worker: RemoteWorker, sha256: str) -> Blob:
    """The blob `sha256` when a live lease of `worker` names it; else the one 403 (an unknown blob too)."""
    gateway.registry.refuse_unless_served(worker, write=False)
    if not _SHA256.match(sha256) or not await gateway.store.leased_blob(worker.id, sha256, now=gateway.now()):
        raise not_leased(sha256)
    try:
        return await gateway.store.get_blob(sha256)
    except BlobNotFound:
        raise not_leased(sha256) from None


def quota_of(gateway: Gateway) -> ArtifactQuota:
    a = gateway.artifacts
    return ArtifactQuota(max_count=a.max_per_attempt, max_bytes=a.max_attempt_bytes, max_blob_bytes=a.max_blob_bytes)


async def held(gateway: Gateway, worker: RemoteWorker, named: LeaseIn) -> Lease:
    """The caller's lease, proved live by renewing it; LeaseGone (410, with its reason) otherwise."""
    attempt_id = named.attempt_id
    answer = await gateway.renew(worker, [named])
    (status,) = answer["leases"]
    if status["status"] == "cancel":
        raise LeaseGone(f"attempt {attempt_id}", "cancelled")
    if status["status"] != "held":
        raise LeaseGone(f"attempt {attempt_id}", str(status.get("reason") or "expired"))
    return lease_of(attempt_id, named.lease_token)


async def check_quota(gateway: Gateway, lease: Lease, name: str, size: int | None) -> bool:
    """Refuse an upload the quotas refuse by its Content-Length alone, before its body is read; whether the
    attempt has recorded `name` already (then the store decides: the same bytes again are the earlier record,
    others a conflict, and no quota counts it twice)."""
    quota = quota_of(gateway)
    if size is not None and size > quota.max_blob_bytes:
        raise BlobTooLarge(quota.max_blob_bytes)
    mine = [a for a in await gateway.store.list_artifacts(lease.task_id) if a.attempt_id == lease.attempt_id]
    if any(a.name == name for a in mine):
        return True
    check_artifact_quota(quota, task_id=lease.task_id, attempt_id=lease.attempt_id, count=len(mine),
                         stored_bytes=sum(a.size for a in mine), adding=size or 0)  # no length: its count alone
    return False


async def record(gateway: Gateway, worker: RemoteWorker, lease: Lease, name: str, chunks: AsyncIterable[bytes], *,
                 expect: str, content_type: str | None) -> Artifact:
    """Store the body as a blob (DigestMismatch, and nothing stored, unless its sha256 is `expect`), then record
    it as the attempt's artifact `name`, fenced again by the store."""
    quota = quota_of(gateway)
    blob, _ = await gateway.store.put_blob(chunks, now=gateway.now(), max_bytes=quota.max_blob_bytes, expect=expect)
    try:
        artifact = await gateway.store.note_artifact(lease, name, blob, content_type=content_type, now=gateway.now(),
                                                     quota=quota, identity=worker.id)
    except QuotaExceeded as exc:
        gateway.metrics.refused.inc((exc.code,))
        log.warning("worker %s: %s", worker.id, exc)
        raise
    except LeaseLost as exc:
        gateway.metrics.refused.inc((exc.reason,))
        raise LeaseGone(f"task {lease.task_id} attempt {lease.attempt_id}", exc.reason) from None
    log.info("task %s attempt %s of worker %s: artifact %s, %d bytes", lease.task_id, lease.attempt_id, worker.id,
             name, artifact.size)
    return artifact
