"""The store's ports: the verbs of each noun an adapter stores, what a worker may call, what the queue
calls, and their small types.

The verbs are grouped as the adapters' modules are (tasks, leases, schedules, upkeep, scans, workers), so
one verb is found in the same-named module of every adapter. Every worker write is fenced by attempt id +
lease token. Execution depends on WorkerPort only, so an adapter that reaches the store from afar (over
HTTPS, for a remote worker) serves that side whole and refuses the rest; the daemon, its API and its
upkeep use QueuePort; an adapter of a whole store is both, Store.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import anyio
from anyio.abc import TaskStatus

from ..errors import LeaseLost, TidepoolError
from ..lifecycle import RetryPolicy
from ..model import (
    Artifact,
    Blob,
    CertSeen,
    Claimed,
    ClaimFilter,
    Lease,
    NewTask,
    Outcome,
    Phase,
    RemoteWorker,
    ResultBatch,
    State,
    Task,
    Worker,
    WorkerChange,
)
from ..scans import JobState, NewScan, Scan, ScanState
from ..schedules import Fired, Schedule


@dataclass(frozen=True, slots=True)
class PhaseNote:
    """A phase/progress change a worker reports; written behind, fenced like every worker write."""

    lease: Lease
    phase: Phase
    progress: dict[str, object] | None = None
    # Set once its run phase has started: how long from this note the attempt may live (its run timeout, the
    # stop phase's bound and one lease). The first such note fixes the attempt's deadline_at; later ones change
    # nothing. Computed by whoever holds the task type's settings: the engine, or for a remote worker its
    # gateway (never the worker).
    deadline_s: float | None = None


@dataclass(frozen=True, slots=True)
class ResultQuota:
    """What one attempt may store: result batches, and their payloads' bytes together (compact JSON, UTF-8)."""

    max_results: int
    max_bytes: int


@dataclass(frozen=True, slots=True)
class ArtifactQuota:
    """What one attempt may record as artifacts: how many, their bytes together, and one blob's bytes."""

    max_count: int
    max_bytes: int
    max_blob_bytes: int


@dataclass(frozen=True, slots=True)
class Ending:
    """How one attempt ended, for finish_many; `now` is when it ended: the lease fence is judged at that time.
    `resent`: an earlier try of this very ending got no answer, so it may have been written already."""

    lease: Lease
    outcome: Outcome
    now: float
    resent: bool = False


@dataclass(frozen=True, slots=True)
class Expired:
    task_id: str
    attempt_id: str
    state: State  # the task's state after expiry
    type: str     # the task's type, for the events and metrics of its ending
    timed_out: bool = False  # its lease ran to its run deadline: the attempt ended timed_out, not expired


@dataclass(frozen=True, slots=True)
class Ended:
    """A task the reconciler ended for good (cancel deadline, unserviceable)."""

    task_id: str
    type: str  # for the events and metrics of its ending


@dataclass(frozen=True, slots=True)
class CancelAnswer:
    state: State  # where the cancel left the task
    moved: bool   # False for a repeated cancel, which found it there already and changed nothing
    type: str     # the task's type, for the events and metrics of a cancel


@dataclass(frozen=True, slots=True)
class Page:
    tasks: list[Task]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class Node:
    """One daemon process of the fleet as the node registry records it; re-saved with every heartbeat."""

    node_id: str
    instance_id: str
    hostname: str
    pid: int
    version: str
    started_at: float
    heartbeat_at: float
    heartbeat_s: float                          # how often this node saves its row
    task_types: tuple[str, ...]
    tags: tuple[tuple[str, ...], ...]           # the tag set of each of its resources
    max_workers: int
    stopped_at: float | None = None             # set by a clean shutdown

    def alive(self, now: float) -> bool:
        """Running and heard from within three heartbeats."""
        return self.stopped_at is None and now - self.heartbeat_at <= 3 * self.heartbeat_s


@dataclass(frozen=True, slots=True)
class ScanPage:
    scans: list[Scan]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class ScanCancel:
    """Where a scan cancel left the scan, and its live task's cancel (None: it had none live)."""

    state: ScanState   # RUNNING while its task is being cancelled, CANCELLED once it has ended
    moved: bool        # False for a repeated cancel, which changed nothing
    task_id: str | None = None
    task: CancelAnswer | None = None


@dataclass(frozen=True, slots=True)
class ScanMove:
    """What one transaction did to one scan beside a task's end: a job's end applied (`index`, `job`), the
    next job's task created (`task_id`, `type`: a task to wake a worker for and announce), the scan ended
    (`finished`)."""

    scan_id: str
    profile: str
    index: int | None = None
    job: JobState | None = None
    task_id: str | None = None
    type: str | None = None
    started: int | None = None  # the index of the job `task_id` is for
    finished: ScanState | None = None


ScanListener = Callable[[Sequence[ScanMove]], None]


Enroll = Literal["manual", "auto"]  # how an unknown identity is recorded at first contact: pending, or enabled


@dataclass(frozen=True, slots=True)
class Revoked:
    """An attempt of a remote worker that a revoke (or an organization taken from it) moved to cancelling:
    the gateway tells the worker to stop it, and reports the cancel."""

    task_id: str
    attempt_id: str
    type: str  # the task's type, for the events and metrics of a cancel


@dataclass(frozen=True, slots=True)
class Acquired:
    """What an acquire found: the worker's record as it read in the transaction (its `live` not counting
    the leases just made), and the tasks leased to it."""

    worker: RemoteWorker
    claimed: list[Claimed]


class LeaseVerbs(Protocol):
    """The verbs of a worker (each adapter's leases.py): lease tasks, keep and note them, store their
    results, end them. Every write is fenced by attempt id + lease token."""

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        """Atomically lease up to `limit` tasks: priority DESC, created_at ASC."""
    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        """Extend the leases, never past their attempt's deadline_at; the ones that could not be renewed, by
        attempt id (DeadlinePassed for those past it)."""
    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        """Record phases and progress (leased -> running on the first); lost leases by attempt id."""
    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float,
                            quota: ResultQuota | None = None) -> ResultBatch:
        """Store a result batch once: sent again under its key, the stored one (Conflict if its sha256 differs).
        The acknowledged batch comes back, its stored_now saying whether this call stored it. With `quota`, a
        new batch that would take its attempt past it raises QuotaExceeded ("result_quota") and changes nothing;
        a batch sent again is no new batch."""
    async def place_input(self, lease: Lease, sha256: str, path: Path) -> None:
        """Write the bytes of blob `sha256`, an input of the leased task, to the new file `path` (streamed, never
        whole in memory). BlobNotFound if the store has no such blob; a remote worker's adapter fetches it
        from its gateway (which answers only for a task the caller holds a live lease on) into its cache."""
    async def record_artifact(self, lease: Lease, name: str, source: Path | bytes, *, content_type: str | None,
                              now: float, quota: ArtifactQuota) -> Artifact:
        """Store `source` (a file, streamed; or bytes) as a blob and record it as the attempt's artifact `name`,
        fenced like a result. Once per (attempt, name): the same sha256 again is the earlier record, another is
        Conflict. BlobTooLarge past quota.max_blob_bytes, QuotaExceeded ("artifact_quota") past the count or
        bytes of quota; neither stores anything."""
    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        """End the attempt; the task's new state. finish_many of this one ending, its error raised."""
    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        """End many attempts at once (one transaction where the store can). Each ending gets, in order, its task's
        new state or its own error: LeaseLost / TaskCancelling when its fence refused it, StoreUnavailable when it
        was not written. Never raises on account of one ending; an empty list gives []."""


class TaskVerbs(Protocol):
    """The queue's tasks (each adapter's tasks.py): producers and readers, cancels and retries."""

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        """Insert a task; with a known idempotency_key return (existing, False) or raise Conflict."""
    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[tuple[str, bool]]:
        """Insert all tasks in one transaction, or none (QueueFull, Conflict): (id, created) in the batch's
        order. A task whose idempotency_key is already used with the same body is that task, not created
        again (a resubmitted batch); with another body, or a key twice in the batch, Conflict."""
    async def get(self, task_id: str) -> Task:
        """The task with its attempts and results; TaskNotFound if unknown."""
    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                   cursor: str | None = None, organization: str | None = None) -> Page:
        """Newest first, without results; of one state, type and organization when given."""
    async def counts(self) -> dict[State, int]:
        """How many tasks are in each non-terminal state."""
    async def organization_counts(self) -> dict[str, int]:
        """How many unfinished tasks each organization has; one with none is left out."""
    async def request_cancel(self, task_id: str, *, now: float) -> CancelAnswer:
        """pending/retry_wait -> cancelled, leased/running -> cancelling; cancelling and cancelled stay
        (a repeated cancel changes nothing); any other terminal state -> Conflict."""
    async def retry(self, task_id: str, *, now: float, max_queued: int | None = None) -> Task:
        """failed/timed_out/cancelled -> pending with max_attempts more attempts; else Conflict. QueueFull
        when the queue holds max_queued tasks already: a retry queues a task as a submit does."""


class ScheduleVerbs(Protocol):
    """Schedules (each adapter's schedules.py): saved, listed, paused, and their due ticks fired once."""

    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        """Create or update a schedule by name; its next tick is recomputed when its timing changed."""
    async def list_schedules(self) -> list[Schedule]: ...
    async def delete_schedule(self, name: str, *, config_node: str | None = None) -> None:
        """ScheduleNotFound if unknown; with config_node, also when that node's config no longer defines it
        (an API save or another node's config took it over meanwhile)."""
    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule: ...
    async def fire_schedules(self, *, now: float,
                             new_task: Callable[[Schedule, float], NewTask | NewScan] | None = None,
                             defines: Callable[[Schedule], bool] = lambda schedule: True,
                             max_queued: int | None = None) -> list[Fired]:
        """In one transaction per schedule: create the due ticks' tasks (a profile schedule's: scans, each with
        its first task) and advance next_run_at. A schedule `defines` refuses (its type or profile is not this
        node's) is left as it is, for a node that defines it; a tick that would take the queue past max_queued
        is skipped (reason "queue_full"), as a submit would be refused. `new_task` makes a tick's task or scan
        (schedules.fire)."""


class UpkeepVerbs(Protocol):
    """The reconciler's passes and the fleet of nodes (each adapter's upkeep.py): expiry, retries due, cancel
    deadlines, pruning, unserviceable tags; one process per node id, and the nodes' rows."""

    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None, interrupted: frozenset[str] = frozenset(),
                            retry_on_timeout: frozenset[str] = frozenset()) -> list[Expired]:
        """Expire leases past their time, or with node_id every lease of that node's other processes. The
        attempts named in `interrupted` (a shutdown stopped them but could not write it) end interrupted. A
        lease that ran to its attempt's deadline_at ends the attempt timed_out (error "timeout"), retried
        only for the task types named in `retry_on_timeout`."""
    async def promote_due(self, *, now: float) -> int:
        """retry_wait tasks whose backoff is over -> pending."""
    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[Ended]:
        """cancelling tasks whose worker did not answer within deadline_s -> cancelled."""
    async def prune(self, *, before: float) -> int:
        """Delete terminal tasks finished before `before`, with their attempts and results."""
    async def queued_tag_sets(self) -> list[frozenset[str]]:
        """The distinct non-empty required_tags of the pending and retry_wait tasks."""
    async def fail_unserviceable(self, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
        """pending/retry_wait tasks whose required_tags are exactly `tags` -> failed ("unserviceable").

        Safe to run on several nodes at once: each task moved is returned by one call only.
        """
    async def save_node(self, node: Node) -> None:
        """Create or replace the registry row of node.node_id (registration, heartbeat, stop)."""
    async def lock_node(self, node_id: str, instance_id: str) -> None:
        """Hold node_id for this process until close(); ConfigError naming the holder if another process has it.

        PostgreSQL: a session advisory lock. SQLite relies on the daemon's lock file; memory has one process.
        """
    async def list_nodes(self) -> list[Node]:
        """Every node that has registered, by node_id."""


class ScanVerbs(Protocol):
    """Scans (each adapter's scans.py). A scan's jobs and their tasks move in the transactions that end those
    tasks: a worker's success of a step task, the merge of what it learned into the scan's scope and the next
    step's task are one transaction; a step that ends failed, timed_out or cancelled (however it ended: an
    expiry, a cancel, the reconciler) ends the scan or lets it go on as the scan says. A job has at most one
    live task; a job's tasks are unique by (scan, index, retry number). A step task that is retried on its
    own (the task retry, not the job's) is refused: it would run outside its scan's order."""

    async def add_scan(self, new: NewScan, *, now: float, max_queued: int | None = None) -> tuple[Scan, bool]:
        """Insert a scan and its first job's task in one transaction. With a known idempotency_key (keys of
        scans are their own, not tasks'): (existing, False), or Conflict when it was used with another body.
        QueueFull when the queue holds max_queued tasks already."""
    async def get_scan(self, scan_id: str) -> Scan:
        """The scan with its jobs; ScanNotFound if unknown."""
    async def list_scans(self, *, state: ScanState | None = None, profile: str | None = None, limit: int = 50,
                         cursor: str | None = None) -> ScanPage:
        """Newest first; next_cursor is the id to pass for the next page (None: this was the last)."""
    async def cancel_scan(self, scan_id: str, *, now: float) -> ScanCancel:
        """Cancel a running scan: its live task as request_cancel does (a queued one ends at once, a leased or
        running one becomes cancelling), its waiting jobs skipped; the scan ends cancelled once that task has
        ended (at once if it had none live). A cancelled scan stays so (moved False); a succeeded or failed
        one -> Conflict. ScanNotFound if unknown."""
    async def retry_job(self, scan_id: str, index: int, *, now: float, max_queued: int | None = None) -> Scan:
        """Retry a failed, timed-out or cancelled job of an ended scan: the scan runs again from that job on
        (the jobs after it wait for their turn again), with a new task for it whose payload has the scope as
        it was before that job, and the scan's scope set back to it. Conflict for any other job or a scan
        not ended, InvalidRequest (field `index`) for an index the scan has not, ScanNotFound, QueueFull."""
    async def advance_scans(self, *, now: float) -> list[ScanMove]:
        """The reconciler's pass: apply the end of every job whose task ended without it (a crash between two
        writes, a path that ends tasks in bulk), start the next job of a running scan with no live task, end
        a scan with nothing left to run. Safe on several nodes at once. The moves made, told to the listener
        as well."""
    def on_scan_moves(self, listener: ScanListener | None) -> None:
        """Call `listener` on the event loop, once they are committed, with the moves of scans made by any call
        but add_scan and retry_job (whose answer says what they did): the endings of finish_many,
        expire_leases, finish_cancels, request_cancel, fail_unserviceable, and cancel_scan's and
        advance_scans' own. To announce them, and to wake a worker for the tasks they created (PostgreSQL
        notifies the other nodes as for any submit)."""


class RemoteWorkerVerbs(Protocol):
    """The worker registry (each adapter's workers.py): the remote workers a gateway serves, one record per
    certificate identity, and their acquires. Their attempts carry the identity as node_id; they are not
    nodes (no row of the fleet), so only their leases' expiry ever expires them."""

    async def meet_worker(self, identity: str, *, cert: CertSeen, address: str | None, now: float,
                          enroll: Enroll, max_concurrent_tasks: int) -> RemoteWorker:
        """Record a contact of `identity`. The first creates its record (pending under manual enrollment,
        enabled under auto; first_seen == last_seen == now, which tells the caller it is new), with
        `max_concurrent_tasks`, every type and the default organization. A later one saves last_seen and
        address, and adds `cert` to its fingerprints if it is new (a rotation). The state never changes
        here: a revoked identity stays revoked. Conflict when `identity` is the id of a node of the fleet:
        the two could not be told apart in the attempts."""
    async def list_workers(self) -> list[RemoteWorker]:
        """Every worker of the registry, by id."""
    async def get_worker(self, worker_id: str) -> RemoteWorker:
        """WorkerNotFound if unknown."""
    async def change_worker(self, worker_id: str, change: WorkerChange, *,
                            now: float) -> tuple[RemoteWorker, list[Revoked]]:
        """Apply an operator's change; the record after it, and the attempts it cancelled. Conflict on a
        revoked worker (final: nothing changes); InvalidRequest naming the field for a bad value. With
        cancel_removed, the worker's leased and running attempts of the organizations taken from it go to
        cancelling in the same transaction, as a task cancel does."""
    async def revoke_worker(self, worker_id: str, *, now: float) -> tuple[RemoteWorker, list[Revoked]]:
        """Revoke for good; in the same transaction each of its leased and running attempts -> cancelling.
        A repeated revoke changes nothing and returns []."""
    async def acquire(self, identity: str, where: ClaimFilter, *, limit: int, now: float, lease_s: float,
                      worker_id: str, slots: Sequence[Sequence[str]], version: str | None) -> Acquired:
        """In one transaction: read the worker's record (saving the slots and version it reports and
        last_seen); unless it is enabled, lease nothing; else lease at most min(limit, max_concurrent_tasks -
        live) tasks of the types `where` asks for (None: any) that its task_types globs allow (fnmatch),
        of the organizations it is assigned, on the tags of where.tag_sets, in queue order; the attempts'
        node_id is the identity. Holds with several gateways on one store: the cap is never exceeded and no
        task is leased twice. WorkerNotFound for an identity never met."""
    async def cancelling_of(self, identity: str) -> list[str]:
        """The attempt ids of the worker's tasks in cancelling: every answer to it names them, so that a worker
        whose control stream is down learns of a cancel at its next call."""
    async def attempt_owners(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        """The node_id of each attempt named (a remote worker's identity, for its attempts); unknown ids are
        left out."""


class BlobVerbs(Protocol):
    """Blobs and artifacts (each adapter's blobs.py). A blob is visible only once whole and durable; its bytes
    live in files under node.state_dir/blobs or in the database ([artifacts] store), its record with the
    queue, so that a blob a task names is never deleted under it."""

    async def put_blob(self, chunks: AsyncIterable[bytes], *, now: float, max_bytes: int,
                       expect: str | None = None) -> tuple[Blob, bool]:
        """Store the bytes `chunks` yields as a blob: (the blob, whether this call created it). DigestMismatch
        when `expect` is not their sha256, BlobTooLarge past `max_bytes`; either stores nothing."""
    async def get_blob(self, sha256: str) -> Blob:
        """BlobNotFound if unknown."""
    def read_blob(self, sha256: str, *, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        """The blob's bytes [start, stop) in chunks of at most 1 MiB. BlobNotFound (at the first chunk)."""
    async def list_artifacts(self, task_id: str) -> list[Artifact]:
        """The task's artifacts, every attempt's, oldest first; TaskNotFound if unknown."""
    async def note_artifact(self, lease: Lease, name: str, blob: Blob, *, content_type: str | None, now: float,
                            quota: ArtifactQuota, identity: str | None = None) -> Artifact:
        """record_artifact for a blob stored already (a gateway's upload): the same fence, idempotence and
        quotas; with `identity`, the attempt must be that remote worker's too (else LeaseLost)."""
    async def leased_blob(self, identity: str, sha256: str, *, now: float) -> bool:
        """Whether `identity` holds a live lease on a task that names blob `sha256` as an input."""
    async def prune_blobs(self, *, before: float, now: float) -> int:
        """Delete the blobs created before `before` that no task names (as an input or an artifact); a blob a
        submit names in the meantime is kept, whichever commits first. How many were deleted."""


class WorkerPort(LeaseVerbs, Protocol):
    """What execution/ may call: a worker's verbs, and the wake-ups of work another node made claimable. An
    adapter that reaches the store from afar (a remote worker's gateway) implements this side whole."""

    async def watch(self, wake: Callable[[int], None], *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: call wake(n) when another node made n tasks claimable (PostgreSQL LISTEN).

        Hints only: a missed wake-up costs latency (the pool's poll stays), never correctness.
        In-process adapters have nothing to hear: the daemon wakes its own pool on submit.
        """


class QueuePort(TaskVerbs, ScheduleVerbs, UpkeepVerbs, ScanVerbs, RemoteWorkerVerbs, BlobVerbs, Protocol):
    """The rest: the store's lifecycle and the queue's verbs, for the daemon, its API and its upkeep."""

    async def open(self, *, migrate: bool = True) -> int:
        """Connect; with `migrate`, bring the schema up to this version's. Returns the schema version the store
        had (0: none yet). SchemaMismatch when it is newer, or older and `migrate` is false."""
    async def close(self) -> None: ...
    async def write_failure(self) -> str | None:
        """Why writes fail now though reads may still answer (SQLite: its last write transaction failed, or
        its file is corrupt or gone; PostgreSQL: the server takes no writes, as a standby after a failover
        does), else None. StoreUnavailable when the store does not answer at all."""


class Store(WorkerPort, QueuePort, Protocol):
    """A whole store: what one adapter of durable storage (memory, SQLite, PostgreSQL) provides."""
