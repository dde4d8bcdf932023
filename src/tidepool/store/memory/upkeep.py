"""The memory store's upkeep: the reconciler's passes (expiry, retries due, cancel deadlines, pruning,
unserviceable tags) and the fleet of nodes.

A pass ends a task through the same ending a worker's does (leases.end), so it moves a step's scan alike.
"""

from __future__ import annotations

from ...lifecycle import Event, RetryPolicy, step
from ...model import QUEUED, AttemptStatus, State, TaskError, cancel_deadline_error
from ..bounds import expiry
from ..port import Ended, Expired, Node
from . import leases, scans
from .database import Database


def expire_leases(db: Database, *, now: float, policy: RetryPolicy, node_id: str | None, keep_instance: str | None,
                  interrupted: frozenset[str], retry_on_timeout: frozenset[str] = frozenset()) -> list[Expired]:
    expired = []
    for row in list(db.tasks.values()):  # a step ended here may insert its next job's task
        lease = row.lease
        if lease is None or not row.task.state.active:
            continue
        mine = node_id is not None and row.task.node_id == node_id and row.lease_instance != keep_instance
        if mine or (node_id is None and lease.expires_at <= now):
            outcome = expiry(lease.attempt_id, interrupted=interrupted, lease_expires_at=lease.expires_at,
                             deadline_at=leases.deadline_of(row), type=row.task.type,
                             retry_on_timeout=retry_on_timeout)
            leases.end(db, row, outcome, now=now, policy=policy)
            expired.append(Expired(row.task.id, lease.attempt_id, row.task.state, row.task.type,
                                   timed_out=outcome.status is AttemptStatus.TIMED_OUT))
    scans.flush(db)
    return expired


def promote_due(db: Database, *, now: float) -> int:
    due = [r for r in db.tasks.values() if r.task.state is State.RETRY_WAIT and r.task.available_at <= now]
    for row in due:
        row.update(state=step(State.RETRY_WAIT, Event.PROMOTE), updated_at=now)
    return len(due)


def finish_cancels(db: Database, *, now: float, deadline_s: float) -> list[Ended]:
    done = []
    for row in list(db.tasks.values()):  # a step ended here may insert its next job's task
        if row.task.state is State.CANCELLING and (row.cancel_requested_at or now) + deadline_s <= now:
            error = cancel_deadline_error(deadline_s)
            if row.lease is not None:
                row.set_attempt(row.lease.attempt_id, status=AttemptStatus.CANCELLED, finished_at=now, error=error)
            row.update(state=step(State.CANCELLING, Event.CANCEL_ACK), finished_at=now, updated_at=now,
                       phase=None, error=error)
            row.lease = None
            done.append(Ended(row.task.id, row.task.type))
            scans.step_ended(db, row, now)
    scans.flush(db)
    return done


def prune(db: Database, *, before: float) -> int:
    old = [i for i, r in db.tasks.items()
           if r.task.state.terminal and r.task.finished_at is not None and r.task.finished_at < before]
    for task_id in old:
        row = db.tasks.pop(task_id)
        if row.task.idempotency_key:
            db.task_keys.pop(row.task.idempotency_key, None)
    db.nodes = {k: n for k, n in db.nodes.items() if n.heartbeat_at >= before}
    scans.prune(db, before=before)
    return len(old)


def queued_tag_sets(db: Database) -> list[frozenset[str]]:
    found = {frozenset(r.task.required_tags) for r in db.tasks.values() if r.task.state in QUEUED}
    return [tags for tags in found if tags]


def fail_unserviceable(db: Database, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
    error = TaskError("unserviceable", message, retryable=False)
    failed = []
    for row in list(db.tasks.values()):  # a step ended here may insert its next job's task
        if row.task.state in QUEUED and frozenset(row.task.required_tags) == tags:
            row.update(state=step(row.task.state, Event.UNSERVICEABLE), error=error, finished_at=now,
                       updated_at=now, phase=None)
            failed.append(Ended(row.task.id, row.task.type))
            scans.step_ended(db, row, now)
    scans.flush(db)
    return failed


def save_node(db: Database, node: Node) -> None:
    db.nodes[node.node_id] = node


def lock_node(db: Database, node_id: str, instance_id: str) -> None:
    """Nothing to lock: one process holds the whole database."""


def list_nodes(db: Database) -> list[Node]:
    return [db.nodes[k] for k in sorted(db.nodes)]
