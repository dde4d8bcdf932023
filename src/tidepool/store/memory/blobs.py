"""The memory store's blobs: their records and bytes in the database's dicts, the artifacts on their tasks'
rows (so pruning a task takes them with it), and a submit's inputs checked against the blobs there."""

from __future__ import annotations

from ...errors import BlobNotFound, LeaseLost, TaskNotFound
from ...model import Artifact, Blob, Lease, State
from ..bounds import check_artifact_quota
from ..port import ArtifactQuota
from ..rules import artifact_taken, check_artifact_name
from .database import Database, TaskRow
from .leases import fenced

WORKING = (State.LEASED, State.RUNNING)  # a worker may still fetch inputs: a cancelling one only stops


def put_blob(db: Database, data: bytes, sha256: str, *, now: float) -> tuple[Blob, bool]:
    """A blob put again is touched: it waits for its submit as long as a new one would."""
    if sha256 in db.blobs:
        old = db.blobs[sha256]
        db.blobs[sha256] = Blob(sha256, old.size, max(old.created_at, now))
        return db.blobs[sha256], False
    db.blobs[sha256], db.blob_bytes[sha256] = Blob(sha256, len(data), now), data
    return db.blobs[sha256], True


def get_blob(db: Database, sha256: str) -> Blob:
    try:
        return db.blobs[sha256]
    except KeyError:
        raise BlobNotFound(sha256) from None


def blob_bytes(db: Database, sha256: str) -> bytes:
    try:
        return db.blob_bytes[sha256]
    except KeyError:
        raise BlobNotFound(sha256) from None


def list_artifacts(db: Database, task_id: str) -> list[Artifact]:
    row = db.tasks.get(task_id)
    if row is None:
        raise TaskNotFound(task_id)
    return list(row.artifacts)


def note_artifact(db: Database, lease: Lease, name: str, blob: Blob, *, content_type: str | None, now: float,
                  quota: ArtifactQuota, identity: str | None = None) -> Artifact:
    row, earlier = admit(db, lease, name, blob.sha256, blob.size, now=now, quota=quota, identity=identity)
    if earlier is not None:
        return earlier
    get_blob(db, blob.sha256)
    artifact = Artifact(name, blob.sha256, blob.size, content_type, lease.attempt_id, now)
    row.artifacts.append(artifact)
    return artifact


def record_artifact(db: Database, lease: Lease, name: str, data: bytes, sha256: str, *, content_type: str | None,
                    now: float, quota: ArtifactQuota) -> Artifact:
    """Admitted first, so that a refused artifact stores no blob either."""
    admit(db, lease, name, sha256, len(data), now=now, quota=quota)
    blob, _ = put_blob(db, data, sha256, now=now)
    return note_artifact(db, lease, name, blob, content_type=content_type, now=now, quota=quota)


def admit(db: Database, lease: Lease, name: str, sha256: str, size: int, *, now: float, quota: ArtifactQuota,
          identity: str | None = None) -> tuple[TaskRow, Artifact | None]:
    """The row an artifact may be recorded on and its earlier record of this name, if any; the fence, the
    idempotence and the quota refuse it otherwise."""
    check_artifact_name(name)
    row = fenced(db, lease, now)
    if identity is not None and row.task.node_id != identity:
        raise LeaseLost(lease.task_id, lease.attempt_id)
    mine = [a for a in row.artifacts if a.attempt_id == lease.attempt_id]
    earlier = next((a for a in mine if a.name == name), None)
    if earlier is not None:
        if earlier.sha256 != sha256:
            raise artifact_taken(lease, name, earlier.sha256)
        return row, earlier
    check_artifact_quota(quota, task_id=lease.task_id, attempt_id=lease.attempt_id, count=len(mine),
                         stored_bytes=sum(a.size for a in mine), adding=size)
    return row, None


def input_bytes(db: Database, lease: Lease, sha256: str) -> bytes:
    """The bytes of an input of the leased task (LeaseLost behind a stale token, BlobNotFound for a blob the task
    does not name)."""
    row = db.tasks.get(lease.task_id)
    if row is None or row.lease is None or (row.lease.attempt_id, row.lease.token) != (lease.attempt_id, lease.token):
        raise LeaseLost(lease.task_id, lease.attempt_id)
    if sha256 not in row.task.inputs.values():
        raise BlobNotFound(sha256)
    return blob_bytes(db, sha256)


def leased_blob(db: Database, identity: str, sha256: str, *, now: float) -> bool:
    return any(row.task.state in WORKING and row.task.node_id == identity and row.lease is not None
               and row.lease.expires_at > now and sha256 in row.task.inputs.values() for row in db.tasks.values())


def prune_blobs(db: Database, *, before: float, now: float) -> int:
    named = _named(db)
    old = [sha for sha, blob in db.blobs.items() if blob.created_at < before and sha not in named]
    for sha in old:
        del db.blobs[sha], db.blob_bytes[sha]
    return len(old)


def _named(db: Database) -> set[str]:
    """Every blob a task or a scan names: a running scan's inputs go to its later steps' tasks."""
    named = {sha for row in db.tasks.values() for sha in row.task.inputs.values()}
    named.update(a.sha256 for row in db.tasks.values() for a in row.artifacts)
    named.update(sha for scan in db.scans.values() for sha in scan.new.inputs.values())
    return named
