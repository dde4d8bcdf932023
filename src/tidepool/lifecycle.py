"""The task state machine: one pure table of (state, event) -> state, and the retry arithmetic."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from .errors import InvalidTransition
from .model import CANCELLED_ON_REQUEST, AttemptStatus, Outcome, State, TaskError


class Event(enum.StrEnum):
    CLAIM = "claim"                    # a worker takes the task under a new lease
    START = "start"                    # the worker begins the phases
    COMPLETE = "complete"              # the attempt succeeded
    FAIL_RETRY = "fail_retry"          # the attempt failed or timed out; attempts remain
    FAIL = "fail"                      # the attempt failed; no attempts left or not retryable
    TIME_OUT = "time_out"              # the run phase exceeded its timeout; not retried
    EXPIRE_RETRY = "expire_retry"      # the lease ran out; attempts remain
    EXPIRE_FAIL = "expire_fail"        # the lease ran out; no attempts left
    INTERRUPT = "interrupt"            # shutdown took the task back; the attempt is not counted
    CANCEL = "cancel"                  # an operator asked to cancel
    CANCEL_ACK = "cancel_ack"          # the worker stopped, or the cancel deadline passed
    PROMOTE = "promote"                # a retry_wait task's backoff is over
    RETRY = "retry"                    # an operator gives a terminal task a new attempt budget
    UNSERVICEABLE = "unserviceable"    # no resource of the fleet can run it any more


P, L, R, W, C = State.PENDING, State.LEASED, State.RUNNING, State.RETRY_WAIT, State.CANCELLING
DONE, FAILED, TIMED_OUT, CANCELLED = State.COMPLETED, State.FAILED, State.TIMED_OUT, State.CANCELLED

TRANSITIONS: dict[tuple[State, Event], State] = {
    (P, Event.CLAIM): L,
    (W, Event.CLAIM): L,
    (W, Event.PROMOTE): P,
    (L, Event.START): R,
    **{(s, e): t for s in (L, R) for e, t in (
        (Event.COMPLETE, DONE),
        (Event.FAIL_RETRY, W),
        (Event.FAIL, FAILED),
        (Event.TIME_OUT, TIMED_OUT),
        (Event.EXPIRE_RETRY, W),
        (Event.EXPIRE_FAIL, FAILED),
        (Event.INTERRUPT, P),
        (Event.CANCEL, C),
    )},
    (P, Event.CANCEL): CANCELLED,
    (W, Event.CANCEL): CANCELLED,
    (C, Event.CANCEL): C,                 # a repeated cancel is a no-op
    (CANCELLED, Event.CANCEL): CANCELLED,
    (C, Event.CANCEL_ACK): CANCELLED,
    # A worker whose task was cancelled under it may still report how it ended; the cancel wins.
    **{(C, e): CANCELLED for e in (Event.COMPLETE, Event.FAIL_RETRY, Event.FAIL, Event.TIME_OUT,
                                   Event.EXPIRE_RETRY, Event.EXPIRE_FAIL, Event.INTERRUPT)},
    **{(s, Event.RETRY): P for s in (FAILED, TIMED_OUT, CANCELLED)},
    (P, Event.UNSERVICEABLE): FAILED,
    (W, Event.UNSERVICEABLE): FAILED,
}


def step(state: State, event: Event) -> State:
    """The state after `event`, or InvalidTransition when the table has no such move."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(state.value, event.value) from None


def backoff_s(attempt: int, *, base_s: float, max_s: float, jitter: float,
              rng: random.Random | None = None) -> float:
    """delay = min(max, base * 2**(attempt-1)) * (1 ± jitter)."""
    delay = min(max_s, base_s * 2.0 ** max(0, attempt - 1))
    spread: float = (rng or random).uniform(-jitter, jitter)
    return max(0.0, delay * (1 + spread))


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    base_s: float = 2.0
    max_s: float = 300.0
    jitter: float = 0.1
    max_interruptions: int = 10


@dataclass(frozen=True, slots=True)
class Decision:
    """What the store writes when an attempt ends: the task's next state and bookkeeping."""

    state: State
    attempt_status: AttemptStatus
    error: TaskError | None
    available_at: float | None = None  # set when the task is queued again
    uncount_attempt: bool = False      # an interruption gives the attempt back


def decide_end(state: State, outcome: Outcome, *, attempt: int, max_attempts: int,
               interruptions: int, policy: RetryPolicy, now: float) -> Decision:
    """How an attempt's outcome moves its task; raises InvalidTransition for an illegal move."""
    status, error = outcome.status, outcome.error
    if state is State.CANCELLING:  # however the attempt ended, the task ends as the cancel asked
        return Decision(step(state, Event.CANCEL_ACK), _cancelled_status(status), CANCELLED_ON_REQUEST)
    if status is AttemptStatus.SUCCEEDED:
        return Decision(step(state, Event.COMPLETE), status, None)
    if status is AttemptStatus.INTERRUPTED:
        if interruptions >= policy.max_interruptions:
            error = TaskError("interrupted", f"interrupted {interruptions + 1} times by shutdowns", False)
            return Decision(step(state, Event.FAIL), status, error, uncount_attempt=True)
        return Decision(step(state, Event.INTERRUPT), status, None, now, uncount_attempt=True)
    if status is AttemptStatus.CANCELLED:
        raise InvalidTransition(state.value, "cancel_ack")
    retry = error is None or error.retryable
    if retry and attempt < max_attempts:
        event = Event.EXPIRE_RETRY if status is AttemptStatus.EXPIRED else Event.FAIL_RETRY
        delay = backoff_s(attempt, base_s=policy.base_s, max_s=policy.max_s, jitter=policy.jitter)
        return Decision(step(state, event), status, error, now + delay)
    if status is AttemptStatus.TIMED_OUT:
        return Decision(step(state, Event.TIME_OUT), status, error)
    event = Event.EXPIRE_FAIL if status is AttemptStatus.EXPIRED else Event.FAIL
    return Decision(step(state, event), status, error)


def _cancelled_status(status: AttemptStatus) -> AttemptStatus:
    # An attempt that was expiring or interrupted when the cancel landed keeps saying so.
    return status if status in (AttemptStatus.EXPIRED, AttemptStatus.INTERRUPTED) else AttemptStatus.CANCELLED
