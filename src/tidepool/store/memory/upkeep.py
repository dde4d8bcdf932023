"""The in-process store's reconciler passes: expiry, retries due, cancel deadlines, pruning, unserviceable tags.

A part of MemoryStore (its base class): it reads and writes the store's task rows, and ends them
through the store's own ending, so a pass moves a scan step's scan as a worker's ending does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...lifecycle import Event, RetryPolicy, step
from ...model import QUEUED, AttemptStatus, Outcome, State, TaskError, cancel_deadline_error
from ..port import Ended, Expired, Node
from ..rules import expiry_outcome

if TYPE_CHECKING:
    from . import _Row
    from .scans import MemoryScans


class MemoryReconciler:
    _rows: dict[str, _Row]
    _keys: dict[str, str]
    _nodes: dict[str, Node]
    _scans: MemoryScans

    if TYPE_CHECKING:
        def _end(self, row: _Row, outcome: Outcome, now: float, policy: RetryPolicy) -> None: ...
        def _step_ended(self, row: _Row, now: float, learned: dict[str, Any] | None = None) -> None: ...

    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None, interrupted: frozenset[str] = frozenset(),
                            ) -> list[Expired]:
        expired = []
        for row in self._rows.values():
            lease = row.lease
            if lease is None or not row.task.state.active:
                continue
            mine = node_id is not None and row.task.node_id == node_id and row.lease_instance != keep_instance
            if mine or (node_id is None and lease.expires_at <= now):
                self._end(row, expiry_outcome(lease.attempt_id, interrupted), now, policy)
                expired.append(Expired(row.task.id, lease.attempt_id, row.task.state, row.task.type))
        self._scans.flush()
        return expired

    async def promote_due(self, *, now: float) -> int:
        due = [r for r in self._rows.values() if r.task.state is State.RETRY_WAIT and r.task.available_at <= now]
        for row in due:
            row.update(state=step(State.RETRY_WAIT, Event.PROMOTE), updated_at=now)
        return len(due)

    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[Ended]:
        done = []
        for row in self._rows.values():
            if row.task.state is State.CANCELLING and (row.cancel_requested_at or now) + deadline_s <= now:
                error = cancel_deadline_error(deadline_s)
                if row.lease is not None:
                    row.set_attempt(row.lease.attempt_id, status=AttemptStatus.CANCELLED, finished_at=now,
                                    error=error)
                row.update(state=step(State.CANCELLING, Event.CANCEL_ACK), finished_at=now, updated_at=now,
                           phase=None, error=error)
                row.lease = None
                done.append(Ended(row.task.id, row.task.type))
                self._step_ended(row, now)
        self._scans.flush()
        return done

    async def prune(self, *, before: float) -> int:
        old = [i for i, r in self._rows.items()
               if r.task.state.terminal and r.task.finished_at is not None and r.task.finished_at < before]
        for task_id in old:
            row = self._rows.pop(task_id)
            if row.task.idempotency_key:
                self._keys.pop(row.task.idempotency_key, None)
        self._nodes = {k: n for k, n in self._nodes.items() if n.heartbeat_at >= before}
        self._scans.prune(before)
        return len(old)

    async def queued_tag_sets(self) -> list[frozenset[str]]:
        found = {frozenset(r.task.required_tags) for r in self._rows.values() if r.task.state in QUEUED}
        return [tags for tags in found if tags]

    async def fail_unserviceable(self, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
        error = TaskError("unserviceable", message, retryable=False)
        failed = []
        for row in self._rows.values():
            if row.task.state in QUEUED and frozenset(row.task.required_tags) == tags:
                row.update(state=step(row.task.state, Event.UNSERVICEABLE), error=error, finished_at=now,
                           updated_at=now, phase=None)
                failed.append(Ended(row.task.id, row.task.type))
                self._step_ended(row, now)
        self._scans.flush()
        return failed
