"""What every store adapter decides alike: room checks, cancel and retry steps, expiry outcomes, who may
end an attempt, and the state sets their SQL names, rendered from the model."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import Conflict, InvalidTransition, QueueFull, TidepoolError
from ..lifecycle import Event, RetryPolicy, step
from ..model import ACTIVE, QUEUED, TERMINAL, AttemptStatus, Lease, NewTask, Outcome, State, TaskError
from .port import Ending, WorkerPort


def sql_states(states: Iterable[State]) -> str:
    """A set of states as an SQL list, `('a', 'b')`, in the model's order."""
    wanted = set(states)
    return "(" + ", ".join(f"'{s.value}'" for s in State if s in wanted) + ")"


QUEUED_SQL = sql_states(QUEUED)          # waiting for a worker: pending, retry_wait
ACTIVE_SQL = sql_states(ACTIVE)          # a lease is held: leased, running, cancelling
WORKING_SQL = sql_states(ACTIVE - {State.CANCELLING})  # a worker may write behind its lease: leased, running
TERMINAL_SQL = sql_states(TERMINAL)      # ended for good
UNFINISHED_SQL = sql_states(set(State) - TERMINAL)


def may_end(state: State, lease_expires_at: float, now: float) -> bool:
    """A worker may end its attempt while its lease is live, and always acknowledge a cancel."""
    return state is State.CANCELLING or (state.active and lease_expires_at > now)


async def finish_alone(store: WorkerPort, lease: Lease, outcome: Outcome, *, now: float,
                       policy: RetryPolicy) -> State:
    """A store's finish(): finish_many of this one ending, its error raised."""
    result = (await store.finish_many([Ending(lease, outcome, now)], policy=policy))[0]
    if isinstance(result, TidepoolError):
        raise result
    return result


LEASE_EXPIRED = TaskError("lease_expired", "the lease expired before the worker renewed it")
EXPIRED = Outcome(AttemptStatus.EXPIRED, LEASE_EXPIRED)
UNWRITTEN_INTERRUPTION = TaskError("interrupted", "interrupted by shutdown; written by the next start (the store "
                                                   "was away)")
INTERRUPTED_UNWRITTEN = Outcome(AttemptStatus.INTERRUPTED, UNWRITTEN_INTERRUPTION)


def expiry_outcome(attempt_id: str, interrupted: frozenset[str]) -> Outcome:
    return INTERRUPTED_UNWRITTEN if attempt_id in interrupted else EXPIRED


def completable_at_once(endings: Sequence[Ending]) -> list[bool]:
    """Which endings may share the adapters' grouped completion: a bare success (nothing more to write
    than the state) that is its task's first ending in the call. Any later ending of a task must meet
    the fence the first one left, so it goes its own way after it."""
    fast, seen = [], set()
    for ending in endings:
        o = ending.outcome
        bare = o.status is AttemptStatus.SUCCEEDED and o.exit_status is None and o.stderr_tail is None
        fast.append(bare and ending.lease.task_id not in seen)
        seen.add(ending.lease.task_id)
    return fast


def progress_text(progress: dict[str, Any] | None) -> str | None:
    """A progress report as the stores keep it (JSON text); None stays None, and the column keeps its value."""
    return None if progress is None else json.dumps(progress)


def check_room(queued: int, adding: int, max_queued: int) -> None:
    """QueueFull when `adding` more tasks would take the queue past max_queued, saying by how much."""
    if queued + adding > max_queued:
        if queued > max_queued:  # a limit lowered under a full queue; PostgreSQL counts no further than this
            raise QueueFull(f"more than {max_queued} tasks are queued; pool.max_queued is {max_queued}")
        these = f"; these {adding} would make {queued + adding}" if adding > 1 else ""
        raise QueueFull(f"{queued} tasks are queued{these}; pool.max_queued is {max_queued}")


def batch_answer(batch: Sequence[NewTask], existing: Mapping[str | None, str],
                 created: Iterable[str]) -> list[tuple[str, bool]]:
    """add_many's answer in the batch's order: (the task its key found, False), else (the next id created,
    True)."""
    new = iter(created)
    return [(existing[n.idempotency_key], False) if n.idempotency_key in existing else (next(new), True)
            for n in batch]


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


def step_retry_refused(task_id: str, scan_id: str, index: int) -> str:
    """Why a scan step's task is not retried on its own: out of its scan's order, its scope would be wrong."""
    return (f"task {task_id} is job {index} of scan {scan_id}; retry the job instead "
            f"(POST /v1/scans/{scan_id}/jobs/{index}/retry), so the steps after it run again")
