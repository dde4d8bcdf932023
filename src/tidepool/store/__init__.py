"""The store port: the verbs the core needs from durable storage, and open_store(url).

Adapters (memory, sqlite, later postgresql) each own their SQL and schema and pass one contract
suite (tests/store/test_contract.py). Every worker write is fenced by attempt id + lease token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import ConfigError, Conflict, InvalidTransition, LeaseLost
from ..lifecycle import Event, RetryPolicy, step
from ..model import Claimed, ClaimFilter, Lease, NewTask, Outcome, Phase, ResultBatch, State, Task, Worker
from ..schedules import Fired, Schedule


@dataclass(frozen=True, slots=True)
class PhaseNote:
    """A phase/progress change a worker reports; written behind, fenced like every worker write."""

    lease: Lease
    phase: Phase
    progress: dict[str, object] | None = None


@dataclass(frozen=True, slots=True)
class Expired:
    task_id: str
    attempt_id: str
    state: State  # the task's state after expiry


@dataclass(frozen=True, slots=True)
class Page:
    tasks: list[Task]
    next_cursor: str | None


class Store(Protocol):
    async def open(self, *, migrate: bool = True) -> None: ...
    async def close(self) -> None: ...

    # producers
    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        """Insert a task; with a known idempotency_key return (existing, False) or raise Conflict."""
    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[str]:
        """Insert all tasks in one transaction, or none (QueueFull, Conflict)."""
    async def get(self, task_id: str) -> Task:
        """The task with its attempts and results; TaskNotFound if unknown."""
    async def list_tasks(self, *, state: State | None = None, type: str | None = None, limit: int = 50,
                   cursor: str | None = None) -> Page:
        """Newest first, without results."""
    async def counts(self) -> dict[State, int]:
        """How many tasks are in each non-terminal state."""
    async def request_cancel(self, task_id: str, *, now: float) -> State:
        """pending/retry_wait -> cancelled, leased/running -> cancelling; terminal -> Conflict."""
    async def retry(self, task_id: str, *, now: float) -> Task:
        """failed/timed_out/cancelled -> pending with max_attempts more attempts; else Conflict."""

    # workers
    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        """Atomically lease up to `limit` tasks: priority DESC, created_at ASC."""
    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        """Extend the leases; the ones that could not be renewed, by attempt id."""
    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        """Record phases and progress (leased -> running on the first); lost leases by attempt id."""
    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float) -> ResultBatch:
        """Store a result batch once (rule 7); the acknowledged batch comes back."""
    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        """End the attempt; the task's new state."""

    # schedules
    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        """Create or update a schedule by name; its next tick is recomputed when its timing changed."""
    async def list_schedules(self) -> list[Schedule]: ...
    async def delete_schedule(self, name: str) -> None:
        """ScheduleNotFound if unknown."""
    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule: ...
    async def fire_schedules(self, *, now: float, max_attempts: int) -> list[Fired]:
        """In one transaction per schedule: create the due ticks' tasks and advance next_run_at."""

    # the reconciler
    async def expire_leases(self, *, now: float, policy: RetryPolicy, node_id: str | None = None,
                            keep_instance: str | None = None) -> list[Expired]:
        """Expire leases past their time, or with node_id every lease of that node's other processes."""
    async def promote_due(self, *, now: float) -> int:
        """retry_wait tasks whose backoff is over -> pending."""
    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[str]:
        """cancelling tasks whose worker did not answer within deadline_s -> cancelled."""
    async def prune(self, *, before: float) -> int:
        """Delete terminal tasks finished before `before`, with their attempts and results."""


def cancel_step(state: State) -> State:
    """Where a cancel request moves a task in `state`; Conflict when it has already ended."""
    try:
        return step(state, Event.CANCEL)
    except InvalidTransition:
        raise Conflict(f"task is {state.value}; only unfinished tasks can be cancelled") from None


def retry_step(state: State) -> State:
    try:
        return step(state, Event.RETRY)
    except InvalidTransition:
        raise Conflict(f"task is {state.value}; only failed, timed_out or cancelled tasks can be retried") \
            from None


def open_store(url: str) -> Store:
    """The adapter for a store URL (not yet opened)."""
    if url.startswith("sqlite:///"):
        from .sqlite import SqliteStore

        return SqliteStore(url.removeprefix("sqlite:///"))
    if url.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresStore

        return PostgresStore(url)
    if url == "memory://":
        from .memory import MemoryStore

        return MemoryStore()
    raise ConfigError(f"config: store.url: unsupported URL {url!r} (use sqlite:///path or postgresql://user:pass@host/db)")
