"""The bounds a store holds every attempt to, whatever its worker says: its run deadline and its result quota.

The run deadline is fixed when the attempt's run phase starts (its run timeout, the stop phase's bound and one
lease later). A renewal never takes the lease past it, so past it every fenced write finds the lease over, and
the reconciler's expiry finds a lease that ran to its deadline: that attempt ends timed_out, not expired. The
quotas count an attempt's stored result batches and their payloads' bytes, and its artifacts and their bytes,
in the transaction that stores one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BlobTooLarge, QuotaExceeded
from ..model import AttemptStatus, Outcome, ResultBatch, TaskError, canonical_json
from .port import ArtifactQuota, ResultQuota
from .rules import expiry_outcome


@dataclass(frozen=True, slots=True)
class RunDeadline:
    """How a node computes an attempt's deadline from its own settings: the run timeout (the task's timeout_s,
    else its type's, else the default), then the stop phase's bound and one lease."""

    default_s: float
    stop_timeout_s: float
    lease_s: float
    type_timeouts: tuple[tuple[str, float], ...] = ()  # (type, timeout_s) of the types that set one

    def seconds(self, type: str, timeout_s: float | None) -> float:
        """How long after its run phase starts an attempt of this task may live."""
        run_s = timeout_s or dict(self.type_timeouts).get(type) or self.default_s
        return run_s + self.stop_timeout_s + self.lease_s


def capped(expires_at: float, deadline_at: float | None) -> float:
    """A lease's new end: never past its attempt's deadline."""
    return expires_at if deadline_at is None else min(expires_at, deadline_at)


def past_deadline(deadline_at: float | None, now: float) -> bool:
    return deadline_at is not None and deadline_at <= now


def timed_out_at_deadline(deadline_at: float, *, retry: bool) -> Outcome:
    return Outcome(AttemptStatus.TIMED_OUT, TaskError(
        "timeout", f"the store's run deadline passed at {deadline_at:.3f} (run timeout + stop_timeout_s + one "
                   "lease after the run phase started) and the worker had not ended the attempt", retry))


def expiry(attempt_id: str, *, interrupted: frozenset[str], lease_expires_at: float, deadline_at: float | None,
           type: str, retry_on_timeout: frozenset[str]) -> Outcome:
    """How the reconciler ends an attempt whose lease is over: timed out when the lease ran to its deadline."""
    if attempt_id not in interrupted and deadline_at is not None and lease_expires_at >= deadline_at:
        return timed_out_at_deadline(deadline_at, retry=type in retry_on_timeout)
    return expiry_outcome(attempt_id, interrupted)


def payload_bytes(batch: ResultBatch) -> int:
    """What a batch counts against its attempt's byte quota: its payload as compact JSON, UTF-8."""
    return len(canonical_json(batch.payload).encode("utf-8", "surrogatepass"))


def check_quota(quota: ResultQuota | None, *, task_id: str, attempt_id: str, count: int, stored_bytes: int,
                adding: int) -> None:
    """QuotaExceeded when one more batch of `adding` bytes would take the attempt past its quota."""
    if quota is None:
        return
    if count + 1 > quota.max_results:
        raise QuotaExceeded("result_quota", f"task {task_id} attempt {attempt_id}: it stored {count} result "
                            f"batches, its quota (max_results_per_attempt); nothing more is stored")
    if stored_bytes + adding > quota.max_bytes:
        raise QuotaExceeded("result_quota", f"task {task_id} attempt {attempt_id}: {adding} more bytes of results "
                            f"would take it past {quota.max_bytes} (max_result_bytes_per_attempt; "
                            f"{stored_bytes} stored); nothing more is stored")


def check_artifact_quota(quota: ArtifactQuota, *, task_id: str, attempt_id: str, count: int, stored_bytes: int,
                         adding: int) -> None:
    """BlobTooLarge or QuotaExceeded ("artifact_quota") when one more artifact of `adding` bytes would take the
    attempt past its quota."""
    if adding > quota.max_blob_bytes:
        raise BlobTooLarge(quota.max_blob_bytes)
    if count + 1 > quota.max_count:
        raise QuotaExceeded("artifact_quota", f"task {task_id} attempt {attempt_id}: it recorded {count} artifacts, "
                            "its quota ([artifacts] max_per_attempt); nothing more is stored")
    if stored_bytes + adding > quota.max_bytes:
        raise QuotaExceeded("artifact_quota", f"task {task_id} attempt {attempt_id}: {adding} more bytes of "
                            f"artifacts would take it past {quota.max_bytes} ([artifacts] max_attempt_bytes; "
                            f"{stored_bytes} stored); nothing more is stored")
