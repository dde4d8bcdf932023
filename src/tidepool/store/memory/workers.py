"""The in-process store's worker registry: the remote workers a gateway serves, and their acquires.

A part of MemoryStore (its base class): it reads and writes the store's task rows. Everything happens
between two awaits, so each verb is one transaction, as the durable stores' are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ...errors import WorkerNotFound
from ...model import CertSeen, ClaimFilter, RemoteWorker, State, Worker, WorkerChange, WorkerState
from ..port import Acquired, Enroll, Node, Revoked
from ..rules import (
    REMOTE_INSTANCE,
    acquire_filter,
    cancel_step,
    changed,
    first_record,
    met_again,
    node_taken,
    reported,
    room,
    spared,
    worth_saving,
)

if TYPE_CHECKING:
    from ...model import Claimed
    from . import _Row


class MemoryRegistry:
    _rows: dict[str, _Row]
    _nodes: dict[str, Node]
    _workers: dict[str, RemoteWorker]

    if TYPE_CHECKING:
        def _claimable(self, where: ClaimFilter, now: float,
                       type_globs: tuple[str, ...] | None = None) -> list[_Row]: ...
        def _lease(self, row: _Row, worker: Worker, now: float, lease_s: float) -> Claimed: ...

    async def meet_worker(self, identity: str, *, cert: CertSeen, address: str | None, now: float,
                          enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
        if identity in self._nodes:
            raise node_taken(identity)
        known = self._workers.get(identity)
        if known is None:
            saved = first_record(identity, cert, address, now, enroll, max_concurrent_tasks)
        else:
            saved = met_again(known, cert, address, now)
        self._workers[identity] = saved
        return self._counted(saved)

    async def list_workers(self) -> list[RemoteWorker]:
        return [self._counted(self._workers[k]) for k in sorted(self._workers)]

    async def get_worker(self, worker_id: str) -> RemoteWorker:
        return self._counted(self._worker(worker_id))

    async def change_worker(self, worker_id: str, change: WorkerChange, *,
                            now: float) -> tuple[RemoteWorker, list[Revoked]]:
        before = self._worker(worker_id)
        after = changed(before, change)
        self._workers[worker_id] = after
        keep = spared(after, change)
        cancelled = self._cancel_active(worker_id, now, lambda row: row.task.organization not in keep) \
            if keep is not None else []
        return self._counted(after), cancelled

    async def revoke_worker(self, worker_id: str, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
        worker = self._worker(worker_id)
        if worker.state is WorkerState.REVOKED:
            return self._counted(worker), []
        self._workers[worker_id] = dataclasses.replace(worker, state=WorkerState.REVOKED)
        cancelled = self._cancel_active(worker_id, now, lambda row: True)
        return self._counted(self._workers[worker_id]), cancelled

    async def acquire(self, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                      worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
        known = self._worker(identity)
        worker = reported(known, slots, version, now)
        if worth_saving(known, worker):
            self._workers[identity] = worker
        worker = self._counted(worker)
        n = room(worker, limit)
        if n == 0:
            return Acquired(worker, [])
        narrowed, globs = acquire_filter(where, worker)
        claimer = Worker(identity, REMOTE_INSTANCE, worker_id)
        rows = self._claimable(narrowed, now, globs)[:n]
        return Acquired(worker, [self._lease(row, claimer, now, lease_s) for row in rows])

    async def attempt_owners(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        wanted = set(attempt_ids)
        return {a.id: a.node_id for row in self._rows.values() for a in row.attempts if a.id in wanted}

    def _worker(self, worker_id: str) -> RemoteWorker:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise WorkerNotFound(worker_id) from None

    def _counted(self, worker: RemoteWorker) -> RemoteWorker:
        live = sum(1 for r in self._rows.values() if r.task.state.active and r.task.node_id == worker.id)
        return dataclasses.replace(worker, live=live)

    def _cancel_active(self, worker_id: str, now: float, which: Callable[[_Row], bool]) -> list[Revoked]:
        """Move the worker's leased and running attempts that `which` picks to cancelling, as a cancel does."""
        cancelled = []
        for row in self._rows.values():
            task = row.task
            if task.node_id != worker_id or task.state not in (State.LEASED, State.RUNNING) or not which(row):
                continue
            assert row.lease is not None
            row.update(state=cancel_step(task.state), updated_at=now)
            row.cancel_requested_at = now
            cancelled.append(Revoked(task.id, row.lease.attempt_id, task.type))
        return cancelled
