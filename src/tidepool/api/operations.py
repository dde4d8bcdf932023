"""What the HTTP API asks of the node it serves: the one interface between `api/` and the rest.

The routes parse and answer; everything they do to the queue, the pool or the schedules goes through
`Operations`. The node's implementation is `tidepool.node.operations.NodeOperations`; a test may serve any
object that has these members.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..events import EventBus
    from ..model import NewTask, RemoteWorker, State, Task, WorkerChange
    from ..scans import Scan, ScanState
    from ..schedules import Schedule
    from ..store import Page
    from ..store.port import ScanPage


class TaskTypes(Protocol):
    """The task types the node defines, by name (the OpenAPI document lists them)."""

    @property
    def types(self) -> Mapping[str, object]: ...


@dataclass(frozen=True, slots=True)
class ScanRequest:
    """A scan submit as the API parsed it, before the node resolves its profile's steps."""

    profile: str
    payload: dict[str, Any]
    priority: int = 0
    organization: str = "default"
    idempotency_key: str | None = None


class ScanOps(Protocol):
    """The node's scans as its API sees them (the node's are tidepool.node.operations.ScanOperations)."""

    @property
    def profiles(self) -> Mapping[str, object]:
        """The scan profiles the node defines, by name (the OpenAPI document lists them)."""
        ...

    async def submit(self, request: ScanRequest) -> tuple[Scan, bool]:
        """The scan, and whether it was created (False: found by its idempotency_key)."""
        ...

    async def get(self, scan_id: str) -> Scan: ...

    async def list(self, *, state: ScanState | None, profile: str | None, limit: int,
                   cursor: str | None) -> ScanPage: ...

    async def cancel(self, scan_id: str) -> ScanState: ...

    async def retry(self, scan_id: str, index: int) -> Scan: ...


class Operations(Protocol):
    """The node as its API sees it. Errors are the project's own (InvalidRequest, TaskNotFound, Conflict,
    QueueFull, StoreUnavailable): the API turns each into its status."""

    @property
    def events(self) -> EventBus: ...

    @property
    def registry(self) -> TaskTypes: ...

    @property
    def max_body_kb(self) -> int: ...

    @property
    def scans(self) -> ScanOps: ...

    @property
    def serves_workers(self) -> bool:
        """Whether the node is a gateway: its document describes the worker protocol too."""
        ...

    def max_attempts_for(self, task_type: str) -> int:
        """The attempt budget of a new task of `task_type` that names none."""
        ...

    async def submit(self, new: NewTask) -> tuple[Task, bool]:
        """The task, and whether it was created (False: found by its idempotency_key)."""
        ...

    async def submit_many(self, news: list[NewTask]) -> list[tuple[str, bool]]: ...

    async def get(self, task_id: str) -> Task: ...

    async def list_tasks(self, *, state: State | None, type: str | None, limit: int, cursor: str | None,
                         organization: str | None = None) -> Page: ...

    async def cancel(self, task_id: str) -> State: ...

    async def retry(self, task_id: str) -> Task: ...

    async def pool_view(self) -> dict[str, Any]: ...

    def resize(self, **sizes: Any) -> None:
        """ValueError when the sizes contradict each other; Conflict while the node drains."""
        ...

    async def nodes_view(self) -> list[dict[str, Any]]: ...

    async def list_workers(self) -> list[RemoteWorker]: ...

    async def get_worker(self, worker_id: str) -> RemoteWorker:
        """WorkerNotFound if unknown."""
        ...

    async def change_worker(self, worker_id: str, change: WorkerChange) -> RemoteWorker:
        """The worker hears it at once (its control stream, its parked acquires); Conflict once revoked."""
        ...

    async def revoke_worker(self, worker_id: str) -> RemoteWorker:
        """Its attempts are cancelled and its connections closed at once."""
        ...

    async def schedules_view(self) -> list[dict[str, Any]]: ...

    async def schedule_view(self, schedule: Schedule) -> dict[str, Any]: ...

    async def save_schedule(self, schedule: Schedule) -> Schedule: ...

    async def delete_schedule(self, name: str) -> None: ...

    async def pause_schedule(self, name: str, *, paused: bool) -> Schedule: ...

    async def not_ready_reason(self) -> str | None:
        """Why /readyz answers 503 ("draining", "starting", the store's failure), or None when ready."""
        ...

    async def render_metrics(self) -> bytes: ...
