"""Every (state, event) pair of the transition table either moves or raises InvalidTransition."""

import pytest

from tidepool.errors import InvalidTransition
from tidepool.lifecycle import TRANSITIONS, Event, RetryPolicy, backoff_s, decide_end, step
from tidepool.model import AttemptStatus, Outcome, State, TaskError

P, L, R, W, C = State.PENDING, State.LEASED, State.RUNNING, State.RETRY_WAIT, State.CANCELLING
DONE, FAILED, TIMED_OUT, CANCELLED = State.COMPLETED, State.FAILED, State.TIMED_OUT, State.CANCELLED
WORKER_ENDS = {Event.COMPLETE: DONE, Event.FAIL_RETRY: W, Event.FAIL: FAILED, Event.TIME_OUT: TIMED_OUT,
               Event.EXPIRE_RETRY: W, Event.EXPIRE_FAIL: FAILED, Event.INTERRUPT: P, Event.CANCEL: C}

EXPECTED: dict[tuple[State, Event], State] = {
    (P, Event.CLAIM): L, (W, Event.CLAIM): L, (W, Event.PROMOTE): P, (L, Event.START): R,
    **{(s, e): t for s in (L, R) for e, t in WORKER_ENDS.items()},
    (P, Event.CANCEL): CANCELLED, (W, Event.CANCEL): CANCELLED, (C, Event.CANCEL): C,
    (CANCELLED, Event.CANCEL): CANCELLED, (C, Event.CANCEL_ACK): CANCELLED,
    **{(C, e): CANCELLED for e in WORKER_ENDS if e is not Event.CANCEL},
    (FAILED, Event.RETRY): P, (TIMED_OUT, Event.RETRY): P, (CANCELLED, Event.RETRY): P,
    (P, Event.UNSERVICEABLE): FAILED, (W, Event.UNSERVICEABLE): FAILED,
}


@pytest.mark.parametrize(("state", "event"), [(s, e) for s in State for e in Event])
def test_every_pair_moves_or_raises(state: State, event: Event) -> None:
    if (state, event) in EXPECTED:
        assert step(state, event) is EXPECTED[(state, event)]
    else:
        with pytest.raises(InvalidTransition):
            step(state, event)


def test_table_has_no_move_the_spec_does_not_name() -> None:
    assert TRANSITIONS == EXPECTED


def test_terminal_states_leave_only_by_retry_or_repeated_cancel() -> None:
    for state in (DONE, FAILED, TIMED_OUT):
        assert {e for (s, e) in TRANSITIONS if s is state} <= {Event.RETRY}
    assert not [e for (s, e) in TRANSITIONS if s is DONE]


@pytest.mark.parametrize("attempt", [1, 2, 3, 8, 20])
def test_backoff_doubles_within_jitter_and_caps(attempt: int) -> None:
    ideal = min(300.0, 2.0 * 2 ** (attempt - 1))
    for _ in range(50):
        delay = backoff_s(attempt, base_s=2.0, max_s=300.0, jitter=0.1)
        assert ideal * 0.9 <= delay <= ideal * 1.1


def end(state: State, status: AttemptStatus, *, attempt: int = 1, max_attempts: int = 3,
        retryable: bool = True, interruptions: int = 0) -> tuple[State, AttemptStatus, bool]:
    error = None if status is AttemptStatus.SUCCEEDED else TaskError("x", "y", retryable)
    e = decide_end(state, Outcome(status, error), attempt=attempt, max_attempts=max_attempts,
                   interruptions=interruptions, policy=RetryPolicy(max_interruptions=2), now=100.0)
    return e.state, e.attempt_status, e.uncount_attempt


@pytest.mark.parametrize(("args", "expected"), [
    ((R, AttemptStatus.SUCCEEDED), (DONE, AttemptStatus.SUCCEEDED, False)),
    ((R, AttemptStatus.FAILED), (W, AttemptStatus.FAILED, False)),
    ((R, AttemptStatus.FAILED, {"attempt": 3}), (FAILED, AttemptStatus.FAILED, False)),
    ((R, AttemptStatus.FAILED, {"retryable": False}), (FAILED, AttemptStatus.FAILED, False)),
    ((R, AttemptStatus.TIMED_OUT, {"retryable": False}), (TIMED_OUT, AttemptStatus.TIMED_OUT, False)),
    ((R, AttemptStatus.TIMED_OUT, {"retryable": True}), (W, AttemptStatus.TIMED_OUT, False)),
    ((R, AttemptStatus.TIMED_OUT, {"retryable": True, "attempt": 3}), (TIMED_OUT, AttemptStatus.TIMED_OUT, False)),
    ((L, AttemptStatus.EXPIRED), (W, AttemptStatus.EXPIRED, False)),
    ((R, AttemptStatus.EXPIRED, {"attempt": 3}), (FAILED, AttemptStatus.EXPIRED, False)),
    ((R, AttemptStatus.INTERRUPTED), (P, AttemptStatus.INTERRUPTED, True)),
    ((R, AttemptStatus.INTERRUPTED, {"interruptions": 2}), (FAILED, AttemptStatus.INTERRUPTED, True)),
    ((C, AttemptStatus.SUCCEEDED), (CANCELLED, AttemptStatus.CANCELLED, False)),
    ((C, AttemptStatus.CANCELLED), (CANCELLED, AttemptStatus.CANCELLED, False)),
    ((C, AttemptStatus.EXPIRED), (CANCELLED, AttemptStatus.EXPIRED, False)),
])
def test_outcomes_move_the_task(args: tuple, expected: tuple) -> None:  # type: ignore[type-arg]
    state, status, *kw = args
    assert end(state, status, **(kw[0] if kw else {})) == expected


@pytest.mark.parametrize("status", [AttemptStatus.SUCCEEDED, AttemptStatus.CANCELLED, AttemptStatus.EXPIRED,
                                    AttemptStatus.FAILED, AttemptStatus.TIMED_OUT, AttemptStatus.INTERRUPTED])
def test_a_cancelled_task_says_it_was_cancelled_however_its_attempt_ended(status: AttemptStatus) -> None:
    """A cancel that found its node cut off ended with the lease: the task said lease_expired."""
    e = decide_end(C, Outcome(status, TaskError("lease_expired", "the lease expired")), attempt=1, max_attempts=3,
                   interruptions=0, policy=RetryPolicy(), now=100.0)
    assert e.state is CANCELLED and e.error is not None and e.error.code == "cancelled"


def test_an_attempt_cannot_end_a_finished_task() -> None:
    for state in (P, W, DONE, FAILED, TIMED_OUT, CANCELLED):
        with pytest.raises(InvalidTransition):
            end(state, AttemptStatus.SUCCEEDED)
