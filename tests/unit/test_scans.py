"""The pure rules of a scan: what follows a job's end, the scope's merge and bound, how jobs and scans read."""

from __future__ import annotations

import pytest

from tidepool.model import State
from tidepool.scans import (
    SCOPE_MAX_BYTES,
    Advance,
    Job,
    JobState,
    NewScan,
    Scan,
    ScanState,
    ScopeRefused,
    StepSpec,
    after_job,
    merge_scope,
    plan,
    retry_from,
    shown,
    shown_scan,
    step_task,
)

W, S, F, T, C, K = (JobState.WAITING, JobState.SUCCESS, JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED,
                    JobState.SKIPPED)


@pytest.mark.parametrize("states, lenient, cancel, expected", [
    ((S, W, W), False, False, Advance(start=1)),
    ((S, S, S), False, False, Advance(finish=ScanState.SUCCEEDED)),
    ((S, F, W), False, False, Advance(finish=ScanState.FAILED, skip=(2,))),
    ((T, W, W), False, False, Advance(finish=ScanState.FAILED, skip=(1, 2))),
    ((S, C, W), False, False, Advance(finish=ScanState.CANCELLED, skip=(2,))),
    ((S, F, W), True, False, Advance(start=2)),
    ((S, C, W), True, False, Advance(start=2)),
    ((F, S, S), True, False, Advance(finish=ScanState.FAILED)),
    ((S, S, W), False, True, Advance(finish=ScanState.CANCELLED, skip=(2,))),
    ((S, F, W), True, True, Advance(finish=ScanState.CANCELLED, skip=(2,))),
    ((W, W), False, False, Advance(start=0)),
])
def test_what_follows_a_jobs_end(states: tuple[JobState, ...], lenient: bool, cancel: bool,
                                 expected: Advance) -> None:
    assert after_job(states, continue_on_failure=lenient, cancel_requested=cancel) == expected


def test_nothing_is_decided_while_a_job_is_started() -> None:
    p = plan([S, JobState.STARTED, W], scope={"a": 1}, continue_on_failure=False, cancel_requested=True)
    assert (p.start, p.finish, p.states) == (None, None, (S, JobState.STARTED, W))


def test_a_plan_applies_the_end_skips_and_starts() -> None:
    p = plan([JobState.STARTED, W, W], scope={}, ended=(0, F), continue_on_failure=False, cancel_requested=False)
    assert p.states == (F, K, K) and p.finish is ScanState.FAILED and p.start is None
    p = plan([JobState.STARTED, W], scope={}, ended=(0, S), continue_on_failure=False, cancel_requested=False)
    assert p.states == (S, JobState.STARTED) and p.start == 1 and p.finish is None


def test_scopes_merge_at_the_top_level_the_newer_key_winning() -> None:
    assert merge_scope({"a": 1, "b": {"x": 1}}, {"b": {"y": 2}, "c": 3}) == {"a": 1, "b": {"y": 2}, "c": 3}
    assert merge_scope({"a": 1}, None) == {"a": 1}


def test_a_scope_past_its_bound_or_not_json_is_refused_saying_which() -> None:
    merge_scope({}, {"k": "x" * (SCOPE_MAX_BYTES - 10)})  # {"k":"..."} is 8 bytes more: fits
    with pytest.raises(ScopeRefused) as caught:
        merge_scope({"k": "x" * (SCOPE_MAX_BYTES // 2)}, {"j": "y" * (SCOPE_MAX_BYTES // 2)})
    assert caught.value.error.code == "scope_too_large" and not caught.value.error.retryable
    for bad in ({1, 2}, float("nan"), object()):
        with pytest.raises(ScopeRefused) as caught:
            merge_scope({}, {"v": bad})
        assert caught.value.error.code == "scope_not_json"


def test_a_steps_task_has_its_steps_defaults_and_the_payload_with_the_scope_over_it() -> None:
    step = StepSpec("http_probe", max_attempts=5, timeout_s=3.0, required_tags=("net",))
    task = step_task(step, payload={"target": "h", "ports": [1]}, scope={"ports": [2], "seen": True}, priority=7,
                     organization="acme")
    assert (task.type, task.max_attempts, task.timeout_s, task.required_tags, task.priority, task.organization) == (
        "http_probe", 5, 3.0, ("net",), 7, "acme")
    assert task.payload == {"target": "h", "ports": [2], "seen": True}
    assert StepSpec.of_json(step.to_json()) == step


@pytest.mark.parametrize("task_state, expected", [
    (State.PENDING, JobState.QUEUED), (State.RETRY_WAIT, JobState.QUEUED), (State.LEASED, JobState.RUNNING),
    (State.RUNNING, JobState.RUNNING), (State.CANCELLING, JobState.RUNNING), (State.COMPLETED, JobState.SUCCESS),
    (State.FAILED, JobState.FAILED), (State.TIMED_OUT, JobState.TIMEOUT), (State.CANCELLED, JobState.CANCELLED),
    (None, JobState.QUEUED),
])
def test_a_started_job_reads_as_its_task_stands(task_state: State | None, expected: JobState) -> None:
    assert shown(JobState.STARTED, task_state) is expected
    assert shown(JobState.SKIPPED, task_state) is JobState.SKIPPED


def test_a_running_scan_reads_pending_until_its_first_task_used_an_attempt() -> None:
    first = Job(0, "a", JobState.QUEUED, "t1", 0, None, 1)
    assert shown_scan(ScanState.RUNNING, [first]) is ScanState.PENDING
    assert shown_scan(ScanState.RUNNING, [Job(0, "a", JobState.QUEUED, "t1", 1, None, 1)]) is ScanState.RUNNING
    assert shown_scan(ScanState.RUNNING, [Job(0, "a", JobState.QUEUED, "t2", 0, None, 2)]) is ScanState.RUNNING
    assert shown_scan(ScanState.FAILED, [first]) is ScanState.FAILED


def scan_of(state: ScanState, *jobs: JobState) -> Scan:
    return Scan("s1", "web", state, "default", {}, {}, 0, False, None,
                tuple(Job(i, "a", j) for i, j in enumerate(jobs)), 0.0, 0.0, None)


def test_a_retry_restarts_its_job_and_sets_every_later_one_waiting() -> None:
    assert retry_from(scan_of(ScanState.FAILED, S, F, K), 1) == [S, JobState.STARTED, W]
    assert retry_from(scan_of(ScanState.FAILED, S, F, S), 1) == [S, JobState.STARTED, W]
    with pytest.raises(ValueError, match="ended"):
        retry_from(scan_of(ScanState.RUNNING, S, F, W), 1)
    with pytest.raises(ValueError, match="success"):
        retry_from(scan_of(ScanState.FAILED, S, F, K), 0)
    with pytest.raises(IndexError):
        retry_from(scan_of(ScanState.FAILED, S, F, K), 3)


def test_the_same_body_is_the_submitters_not_the_profiles_steps() -> None:
    one = NewScan("web", (StepSpec("a"),), payload={"t": 1}, idempotency_key="k")
    assert one.fingerprint() == NewScan("web", (StepSpec("a"), StepSpec("b")), payload={"t": 1},
                                        idempotency_key="k").fingerprint()
    assert one.fingerprint() != NewScan("web", (StepSpec("a"),), payload={"t": 2}, idempotency_key="k").fingerprint()
    assert NewScan("web", (StepSpec("a"),)).fingerprint() == ""
    with pytest.raises(ValueError, match="at least one step"):
        NewScan("empty", ())
