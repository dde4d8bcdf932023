"""Blobs and artifacts in the SQLite store: the blobs' rows and the artifacts' (the bytes are files of the
store's blob directory, blobfiles.py), written as ops of the writer thread, read on the reader.

A task's inputs are written with its row (tasks.py) and a scan's with the scan's (scans.py); this module
serves what comes after: the fenced artifacts of an attempt, the inputs a lease may read, the pruning.
"""

from __future__ import annotations

import sqlite3

from ...errors import BlobNotFound, LeaseLost, TaskNotFound
from ...model import Artifact, Blob, Lease, State
from .. import sql
from ..bounds import check_artifact_quota
from ..port import ArtifactQuota
from ..rows import artifact_of
from ..rules import artifact_taken, check_artifact_name
from . import tasks
from .database import Batch
from .leases import fence, why_lost

Q = sql.queries(__package__, "blobs.sql")


def put_blob(conn: sqlite3.Connection, batch: Batch, *, sha256: str, size: int, now: float) -> tuple[Blob, bool]:
    """The blob's row, once its file is in place; one there already is touched, not made again."""
    row = conn.execute(Q["touch_blob"], (now, sha256)).fetchone()
    if row is not None:
        return Blob(*row), False
    conn.execute(Q["insert_blob"], (sha256, size, now))
    return Blob(sha256, size, now), True


def get_blob(conn: sqlite3.Connection, *, sha256: str) -> Blob:
    row = conn.execute(Q["blob"], (sha256,)).fetchone()
    if row is None:
        raise BlobNotFound(sha256)
    return Blob(*row)


def list_artifacts(conn: sqlite3.Connection, *, task_id: str) -> list[Artifact]:
    if conn.execute(Q["task_exists"], (task_id,)).fetchone() is None:
        raise TaskNotFound(task_id)
    return tasks.artifacts_of(conn, task_id)


def note_artifact(conn: sqlite3.Connection, batch: Batch, *, lease: Lease, name: str, blob: Blob,
                  content_type: str | None, now: float, quota: ArtifactQuota, identity: str | None) -> Artifact:
    earlier = admit(conn, lease=lease, name=name, sha256=blob.sha256, size=blob.size, now=now, quota=quota,
                    identity=identity)
    if earlier is not None:
        return earlier
    get_blob(conn, sha256=blob.sha256)
    conn.execute(Q["insert_artifact"], (lease.attempt_id, lease.task_id, name, blob.sha256, blob.size,
                                        content_type, now))
    return Artifact(name, blob.sha256, blob.size, content_type, lease.attempt_id, now)


def admit(conn: sqlite3.Connection, *, lease: Lease, name: str, sha256: str | None, size: int, now: float,
          quota: ArtifactQuota, identity: str | None = None) -> Artifact | None:
    """The attempt's earlier artifact of this name, or None when a new one may be recorded; the fence, the
    idempotence and the quota refuse it otherwise. Without `sha256` (bytes not yet stored: a check before
    they are), an earlier artifact of the name is not judged."""
    check_artifact_name(name)
    holder = conn.execute(Q["holder"], (*fence(lease), now)).fetchone()
    if holder is None or holder[0] not in (State.LEASED, State.RUNNING):
        raise why_lost(conn, lease, now)
    if identity is not None and holder[1] != identity:
        raise LeaseLost(lease.task_id, lease.attempt_id)
    earlier = conn.execute(Q["artifact_by_name"], (lease.attempt_id, name)).fetchone()
    if earlier is not None:
        if sha256 is not None and earlier[1] != sha256:
            raise artifact_taken(lease, name, earlier[1])
        return artifact_of(earlier)
    count, stored = conn.execute(Q["artifact_counts"], (lease.attempt_id,)).fetchone()
    check_artifact_quota(quota, task_id=lease.task_id, attempt_id=lease.attempt_id, count=count,
                         stored_bytes=stored, adding=size)
    return None


def check_input(conn: sqlite3.Connection, *, lease: Lease, sha256: str) -> None:
    """LeaseLost behind a stale token, BlobNotFound for a blob the leased task does not name."""
    if conn.execute(Q["held"], fence(lease)).fetchone() is None:
        raise LeaseLost(lease.task_id, lease.attempt_id)
    if conn.execute(Q["is_input"], (lease.task_id, sha256)).fetchone() is None:
        raise BlobNotFound(sha256)


def leased_blob(conn: sqlite3.Connection, *, identity: str, sha256: str, now: float) -> bool:
    return bool(conn.execute(Q["leased_blob"], (sha256, identity, now)).fetchone()[0])


def prune_blobs(conn: sqlite3.Connection, batch: Batch, *, before: float) -> list[str]:
    """Delete the rows of the old blobs nothing names; their sha256s, whose files go next."""
    return [r[0] for r in conn.execute(Q["prune_blobs"], (before,)).fetchall()]
