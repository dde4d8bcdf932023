"""The operations protocol: what the HTTP API asks of the node it serves, the one interface between `api/` and
the rest.

The routes parse and answer; everything they do to the queue, the pool or the schedules goes through
`Operations`, which answers with domain objects and, where an answer holds more than one, the plain views
declared here: the API renders them. The node's implementation is `tidepool.node.operations.NodeOperations`;
a test may serve any object that has these members.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

if TYPE_CHECKING:
    from ..events import EventBus
    from ..model import Artifact, Blob, NewTask, RemoteWorker, State, Task, WorkerChange
    from ..scans import Scan, ScanState
    from ..schedules import Schedule
    from ..store.port import Node, Page, ScanPage


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
    inputs: dict[str, str] = field(default_factory=dict)  # file name -> sha256 of a stored blob


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


class PoolFigures(Protocol):
    """The pool's sizes and how many of its workers do what (the node's: execution's pool statistics)."""

    @property
    def min_workers(self) -> int: ...
    @property
    def max_workers(self) -> int: ...
    @property
    def idle_timeout_s(self) -> float: ...
    @property
    def workers(self) -> int: ...
    @property
    def busy(self) -> int: ...
    @property
    def baseline(self) -> int: ...
    @property
    def demand(self) -> int: ...
    @property
    def claiming(self) -> bool: ...


class GuardFigures(Protocol):
    """The host guards' floors and what they last measured (the node's: execution's guard statistics)."""

    @property
    def tripped(self) -> Sequence[str]: ...
    @property
    def min_free_memory_mb(self) -> int: ...
    @property
    def min_free_disk_mb(self) -> int: ...
    @property
    def free_memory_mb(self) -> int | None: ...
    @property
    def free_disk_mb(self) -> int | None: ...


class ResourceFigures(Protocol):
    """One resource: its slots, how many are in use, and their tags."""

    @property
    def tags(self) -> Sequence[str]: ...
    @property
    def count(self) -> int: ...
    @property
    def in_use(self) -> int: ...


@dataclass(frozen=True, slots=True)
class PoolView:
    """The pool as GET /v1/pool shows it: its figures beside the node's own state, the queue by unfinished
    state (in the whole store), the host guards and the resources."""

    pool: PoolFigures
    node_id: str
    draining: bool
    queue: Mapping[str, int]
    guards: GuardFigures
    resources: Mapping[str, ResourceFigures]
    pending_restart: list[str]  # settings a reload read that apply at the next start


@dataclass(frozen=True, slots=True)
class NodesView:
    """The fleet as GET /v1/nodes shows it, read at `now`: the nodes of the store's registry, and the remote
    workers a gateway serves (each alive while served and heard from within `heard_within_s`)."""

    nodes: Sequence[Node]
    remote_workers: Sequence[RemoteWorker]
    now: float
    heard_within_s: float


@dataclass(frozen=True, slots=True)
class ScheduleView:
    """A schedule with the state of the last task or scan it made (None: none yet, or pruned since)."""

    schedule: Schedule
    last_task_state: State | None = None
    last_scan_state: ScanState | None = None


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

    async def pool_view(self) -> PoolView: ...

    @property
    def max_blob_bytes(self) -> int:
        """The most bytes one blob may hold ([artifacts] max_blob_bytes)."""
        ...

    async def put_blob(self, chunks: AsyncIterable[bytes], *, expect: str | None = None) -> tuple[Blob, bool]:
        """Store an upload as a blob: the blob, and whether this call created it. DigestMismatch, BlobTooLarge."""
        ...

    async def get_blob(self, sha256: str) -> Blob:
        """BlobNotFound if unknown."""
        ...

    def read_blob(self, sha256: str, *, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        """The blob's bytes [start, stop), streamed in chunks."""
        ...

    async def list_artifacts(self, task_id: str) -> list[Artifact]:
        """The task's artifacts, every attempt's, oldest first; TaskNotFound if unknown."""
        ...

    def resize(self, **sizes: Any) -> None:
        """ValueError when the sizes contradict each other; Conflict while the node drains."""
        ...

    async def nodes_view(self) -> NodesView: ...

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

    async def schedules_view(self) -> list[ScheduleView]: ...

    async def schedule_view(self, schedule: Schedule) -> ScheduleView: ...

    async def save_schedule(self, schedule: Schedule) -> Schedule: ...

    async def delete_schedule(self, name: str) -> None: ...

    async def pause_schedule(self, name: str, *, paused: bool) -> Schedule: ...

    async def not_ready_reason(self) -> str | None:
        """Why /readyz answers 503 ("draining", "starting", the store's failure), or None when ready."""
        ...

    async def render_metrics(self) -> bytes: ...


DAEMON: web.AppKey[Operations] = web.AppKey("daemon")  # the node the API serves, as its operations
