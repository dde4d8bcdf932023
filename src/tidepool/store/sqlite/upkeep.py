"""Upkeep in the SQLite store: the reconciler's passes (expiry, retries due, cancel deadlines, pruning,
unserviceable tags) and the fleet of nodes.

The passes run on the writer thread like every other op, and end a scan's step as any end does: its scan
moves on in the same transaction. One host holds the file, so the daemon's lock file keeps one process per
node id, and the nodes' rows say who ran last.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]

from ...errors import ConfigError
from ...lifecycle import Event, RetryPolicy, step
from ...model import AttemptStatus, Lease, State, TaskError, cancel_deadline_error
from .. import sql
from ..bounds import expiry
from ..port import Ended, Expired, Node
from ..rows import error_text, node_of, node_values
from . import leases, scans
from .database import Batch, chunks, marks

Q = sql.queries(__package__, "upkeep.sql")

# the reconciler


def expire_leases(conn: sqlite3.Connection, batch: Batch, *, now: float, policy: RetryPolicy, node_id: str | None,
                  keep_instance: str | None, interrupted: frozenset[str],
                  retry_on_timeout: frozenset[str] = frozenset()) -> list[Expired]:
    if node_id is None:
        rows = conn.execute(Q["expiring"], (now,)).fetchall()
    else:
        rows = conn.execute(Q["expiring_of_node"], (node_id, keep_instance)).fetchall()
    expired = []
    deadlines = deadlines_of(conn, [row[6] for row in rows])
    for row in rows:
        lease = Lease(row[5], row[6], row[7], row[4])
        outcome = expiry(lease.attempt_id, interrupted=interrupted, lease_expires_at=row[4],
                         deadline_at=deadlines.get(lease.attempt_id), type=row[8], retry_on_timeout=retry_on_timeout)
        state = leases.end(conn, lease, outcome, row, now, policy, batch, step=row[9:11])
        expired.append(Expired(lease.task_id, lease.attempt_id, state, row[8],
                               timed_out=outcome.status is AttemptStatus.TIMED_OUT))
    return expired


def deadlines_of(conn: sqlite3.Connection, attempt_ids: list[str]) -> dict[str, float]:
    """The run deadline of each attempt named that has one (read apart: the expiry's own reads stay on their
    index of tasks)."""
    found: dict[str, float] = {}
    for chunk in chunks(attempt_ids):
        found.update(conn.execute(Q["deadlines"].format(marks=marks(len(chunk))), chunk).fetchall())
    return found


def promote_due(conn: sqlite3.Connection, batch: Batch, *, now: float) -> int:
    return int(conn.execute(Q["promote_due"], (now, now)).rowcount)


def finish_cancels(conn: sqlite3.Connection, batch: Batch, *, now: float, deadline_s: float) -> list[Ended]:
    rows = conn.execute(Q["cancels_due"], (now - deadline_s,)).fetchall()
    error = error_text(cancel_deadline_error(deadline_s))
    for task_id, attempt_id, _, *scan in rows:
        conn.execute(Q["cancel_attempt"], (now, error, attempt_id))
        conn.execute(Q["cancel_task"], (step(State.CANCELLING, Event.CANCEL_ACK), error, now, now, task_id))
        scans.task_ended(conn, batch, scan, task_id, State.CANCELLED, now)
    return [Ended(r[0], r[2]) for r in rows]


def prune(conn: sqlite3.Connection, batch: Batch, *, before: float) -> int:
    conn.execute(Q["prune_results"], (before,))
    conn.execute(Q["prune_attempts"], (before,))
    conn.execute(Q["prune_inputs"], (before,))
    conn.execute(Q["prune_artifacts"], (before,))
    conn.execute(Q["prune_nodes"], (before,))
    conn.execute(Q["prune_scan_inputs"], (before,))
    conn.execute(Q["prune_jobs"], (before,))
    conn.execute(Q["prune_scans"], (before,))
    return int(conn.execute(Q["prune_tasks"], (before,)).rowcount)


def queued_tag_sets(conn: sqlite3.Connection) -> list[frozenset[str]]:
    return [frozenset(json.loads(r[0])) for r in conn.execute(Q["queued_tag_sets"])]


def fail_unserviceable(conn: sqlite3.Connection, batch: Batch, *, tags: frozenset[str], now: float,
                       message: str) -> list[Ended]:
    error = error_text(TaskError("unserviceable", message, retryable=False))
    target = step(State.PENDING, Event.UNSERVICEABLE)  # retry_wait moves the same way
    rows = conn.execute(Q["fail_unserviceable"], (target, error, now, now, json.dumps(sorted(tags)))).fetchall()
    if batch.queued is not None:
        batch.queued -= len(rows)
    for r in rows:
        scans.task_ended(conn, batch, r[2:4], r[0], target, now)
    return [Ended(r[0], r[1]) for r in rows]


# the fleet


def save_node(conn: sqlite3.Connection, batch: Batch, *, node: Node) -> None:
    conn.execute(Q["save_node"], node_values(node, task_types=json.dumps(list(node.task_types))))


def lock_node(conn: sqlite3.Connection, *, node_id: str, instance_id: str, path: Path) -> None:
    """The daemon's lock file keeps one process per node id; a lock file deleted while its daemon ran would not,
    so the node's own row is asked as well: a live process of this node on this host. On the reader."""
    holder = node_row(conn, node_id)
    if holder is not None and holder.instance_id != instance_id and _alive_here(holder):
        raise ConfigError(f"node {node_id} already runs on {path}: pid {holder.pid} (instance "
                          f"{holder.instance_id}, heard from {time.time() - holder.heartbeat_at:.0f}s ago); "
                          "stop it or give this daemon another node.id")


def list_nodes(conn: sqlite3.Connection) -> list[Node]:
    return [_node(r) for r in conn.execute(Q["nodes"])]


def node_row(conn: sqlite3.Connection, node_id: str) -> Node | None:
    row = conn.execute(Q["node"], (node_id,)).fetchone()
    return None if row is None else _node(row)


def _node(row: Any) -> Node:
    return node_of(row, task_types=json.loads(row[9]))


def _alive_here(node: Node) -> bool:
    """Whether the process a node row names still runs on this host, and is that process (a pid reused
    since was born after the node started)."""
    if node.stopped_at is not None or node.hostname != socket.gethostname() or node.pid == os.getpid():
        return False
    try:
        process = psutil.Process(node.pid)
        born: float = process.create_time()
        return born <= node.started_at + 1.0 and process.status() != psutil.STATUS_ZOMBIE  # killed, not reaped
    except psutil.Error:
        return False
