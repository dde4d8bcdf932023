"""The queue's verbs on a remote worker: they belong to its gateway, so each refuses with RemoteNode
(409 remote_worker on the worker's own API, naming the gateway to ask instead)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...errors import RemoteNode
from ...lifecycle import RetryPolicy
from ...model import CertSeen, ClaimFilter, NewTask, RemoteWorker, State, Task, WorkerChange
from ...scans import NewScan, Scan, ScanState
from ...schedules import Fired, Schedule
from ..port import (
    Acquired,
    CancelAnswer,
    Ended,
    Enroll,
    Expired,
    Node,
    Page,
    Revoked,
    ScanCancel,
    ScanListener,
    ScanMove,
    ScanPage,
)


class RemoteQueue:
    def __init__(self, url: str) -> None:
        self.url = url

    def _refuse(self) -> RemoteNode:
        return RemoteNode(self.url)

    async def counts(self) -> dict[State, int]:
        """The queue is the gateway's: none of it is counted here."""
        return {}

    async def organization_counts(self) -> dict[str, int]:
        return {}

    async def lock_node(self, node_id: str, instance_id: str) -> None:
        """The gateway knows this worker by its certificate; this host's lock file keeps it one process."""

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        raise self._refuse()

    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[tuple[str, bool]]:
        raise self._refuse()

    async def get(self, task_id: str) -> Task:
        raise self._refuse()

    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                         cursor: str | None = None, organization: str | None = None) -> Page:
        raise self._refuse()

    async def request_cancel(self, task_id: str, *, now: float) -> CancelAnswer:
        raise self._refuse()

    async def retry(self, task_id: str, *, now: float, max_queued: int | None = None) -> Task:
        raise self._refuse()

    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        raise self._refuse()

    async def list_schedules(self) -> list[Schedule]:
        raise self._refuse()

    async def delete_schedule(self, name: str, *, config_node: str | None = None) -> None:
        raise self._refuse()

    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule:
        raise self._refuse()

    async def fire_schedules(self, *, now: float,
                             new_task: Callable[[Schedule, float], NewTask | NewScan] | None = None,
                             defines: Callable[[Schedule], bool] = lambda schedule: True,
                             max_queued: int | None = None) -> list[Fired]:
        raise self._refuse()

    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None, interrupted: frozenset[str] = frozenset(),
                            ) -> list[Expired]:
        raise self._refuse()

    async def promote_due(self, *, now: float) -> int:
        raise self._refuse()

    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[Ended]:
        raise self._refuse()

    async def prune(self, *, before: float) -> int:
        raise self._refuse()

    async def queued_tag_sets(self) -> list[frozenset[str]]:
        raise self._refuse()

    async def fail_unserviceable(self, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
        raise self._refuse()

    async def list_nodes(self) -> list[Node]:
        raise self._refuse()

    # the worker registry is the gateway's

    async def meet_worker(self, identity: str, *, cert: CertSeen, address: str | None, now: float,
                          enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
        raise self._refuse()

    async def list_workers(self) -> list[RemoteWorker]:
        raise self._refuse()

    async def get_worker(self, worker_id: str) -> RemoteWorker:
        raise self._refuse()

    async def change_worker(self, worker_id: str, change: WorkerChange, *,
                            now: float) -> tuple[RemoteWorker, list[Revoked]]:
        raise self._refuse()

    async def revoke_worker(self, worker_id: str, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
        raise self._refuse()

    async def acquire(self, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                      worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
        raise self._refuse()

    async def attempt_owners(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        raise self._refuse()

    # scans are the gateway's too: their steps' tasks reach this worker as any task does
    async def add_scan(self, new: NewScan, *, now: float, max_queued: int | None = None) -> tuple[Scan, bool]:
        raise self._refuse()

    async def get_scan(self, scan_id: str) -> Scan:
        raise self._refuse()

    async def list_scans(self, *, state: ScanState | None = None, profile: str | None = None, limit: int = 50,
                         cursor: str | None = None) -> ScanPage:
        raise self._refuse()

    async def cancel_scan(self, scan_id: str, *, now: float) -> ScanCancel:
        raise self._refuse()

    async def retry_job(self, scan_id: str, index: int, *, now: float, max_queued: int | None = None) -> Scan:
        raise self._refuse()

    async def advance_scans(self, *, now: float) -> list[ScanMove]:
        return []

    def on_scan_moves(self, listener: ScanListener | None) -> None:
        """No scan moves here: a step's end and its next task are made where the store is."""
