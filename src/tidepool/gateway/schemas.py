"""The worker protocol's bodies: what a remote worker may send under /w1 (extra fields refused, every list
bounded) and what each answer holds, from which the OpenAPI document is built as well."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from ..http.answers import Answer, ErrorBody, TaskDetailOut
from ..http.bodies import JsonInt, integral
from ..model import Phase
from ..scans import SCOPE_MAX_BYTES
from ..settings import Tag

MAX_ACQUIRE = 256        # tasks one acquire may ask for
MAX_BATCH = 1000         # leases, notes or endings in one call
MAX_SLOTS = 1000         # resource slots a worker may report
MAX_WAIT_S = 3600.0      # a wait_s past this is a mistake; within it, gateway.max_wait_s clips it
ID = Field(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z_-]+$")
TOKEN = Field(min_length=1, max_length=200, pattern=r"^[0-9A-Za-z_-]+\.[0-9a-f]+$")
EndStatus = Literal["succeeded", "failed", "timed_out", "cancelled", "interrupted"]
WorkerStateName = Literal["pending", "enabled", "disabled", "revoked"]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _one_each(items: list[Any]) -> list[Any]:
    """A batch names each attempt once: written twice in one call, the second write of an attempt would be
    refused behind the lease the first one moved (an ending) and its answer would hide the first one's."""
    seen: set[str] = set()
    for item in items:
        if item.attempt_id in seen:
            raise ValueError(f"attempt {item.attempt_id} is named twice: one entry per attempt")
        seen.add(item.attempt_id)
    return items


OneEach = AfterValidator(_one_each)


class AcquireIn(Body):
    types: list[str] = Field(max_length=1000, description="the task types the worker runs (names, not globs)")
    slots: list[list[Tag]] = Field(default_factory=list, max_length=MAX_SLOTS,
                                   description="the tag set of each free resource slot")
    max: JsonInt = Field(1, ge=1, le=MAX_ACQUIRE)
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S, description="hold up to this long (at most gateway.max_wait_s)")
    request_id: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$",
                                   description="sent again, within lease_s, answers the same leases")


class LeaseIn(Body):
    attempt_id: str = ID
    lease_token: str = TOKEN


class RenewIn(Body):
    leases: Annotated[list[LeaseIn], OneEach] = Field(max_length=MAX_BATCH)


class ProgressIn(Body):
    fraction: float = Field(ge=0, le=1)
    message: str = Field("", max_length=1000)


class NoteIn(LeaseIn):
    phase: Phase
    progress: ProgressIn | None = None


class PhaseIn(Body):
    notes: Annotated[list[NoteIn], OneEach] = Field(max_length=MAX_BATCH)


class ResultIn(LeaseIn):
    plugin: str = Field(min_length=1, max_length=200)
    sequence: JsonInt = Field(ge=0, le=2**31)
    idempotency_key: str = Field(min_length=1, max_length=512, pattern=r"^[^\x00]*$",
                                 description="stored as <task id>:<key> unless it starts with the lease's task or "
                                             "attempt id and a colon")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="of the payload as compact JSON with sorted keys")
    final: bool = False
    payload: Any = None


class ErrorIn(Body):
    code: str = Field(min_length=1, max_length=100)
    message: str = Field("", max_length=4000)


class EndingIn(LeaseIn):
    status: EndStatus
    error: ErrorIn | None = None
    retryable: bool | None = None
    exit_status: Annotated[int, Field(ge=-255, le=255), BeforeValidator(integral)] | None = Field(
        None, description="a command plugin's")
    stderr_tail: str | None = Field(None, max_length=4096, description="a command plugin's last 4 KiB of stderr")
    scope: dict[str, Any] | None = Field(
        None, description="with a success: what the attempt's plugins put in ctx.scope, merged at the top level "
                          "into its scan's scope (a scan step's; any other task ignores it). A scan's scope that would "
                          f"pass {SCOPE_MAX_BYTES} bytes of compact JSON with it fails the step with scope_too_large, "
                          "as when the step runs on a node of the store itself")


class FinishIn(Body):
    endings: Annotated[list[EndingIn], OneEach] = Field(max_length=MAX_BATCH)


# answers


class LeaseOut(Answer):
    task: TaskDetailOut
    attempt_id: str
    lease_token: str = Field(description="opaque: sent back with every write of the attempt")
    lease_expires_at: str


class AcquireOut(Answer):
    tasks: list[LeaseOut]
    worker_state: WorkerStateName
    lease_s: float
    renew_after_s: float
    cancel: list[str] = Field(default_factory=list, description="the caller's attempts being cancelled: stop them "
                                                                "and finish each as cancelled, as for a renewal's "
                                                                "status cancel")


class LeaseStatusOut(Answer):
    attempt_id: str
    status: Literal["held", "cancel", "lost"]
    lease_expires_at: str | None = None
    reason: str | None = None


class RenewOut(Answer):
    leases: list[LeaseStatusOut]
    worker_state: WorkerStateName


class PhaseOut(Answer):
    lost: list[str]


class ResultAckOut(Answer):
    attempt_id: str
    plugin: str
    sequence: int
    idempotency_key: str
    sha256: str
    final: bool


class EndingOut(Answer):
    attempt_id: str
    state: str | None = None
    lost: str | None = Field(None, description="why the ending was refused: expired, cancelled, revoked, superseded, "
                                               "deadline")
    error: ErrorBody | None = Field(None, description="value_refused: the store refused a value of this ending; "
                                    "sent again it would be refused again (the worker records a failure instead)")


class FinishOut(Answer):
    endings: list[EndingOut]


class ControlOut(Answer):
    """One event of GET /w1/control: cancel {attempt_id}, worker {state}, wake {n}."""

    event: Literal["cancel", "worker", "wake"]
    data: dict[str, Any]


class LeaseGoneBody(Answer):
    """A write behind a lease the worker no longer holds: why, in `reason`."""

    code: Literal["lease_lost"]
    message: str
    reason: Literal["expired", "cancelled", "revoked", "superseded", "deadline"] = Field(
        description="expired: not renewed in time; cancelled: the task is being cancelled; revoked: the worker is; "
                    "superseded: another attempt holds the task, or the attempt is not the caller's; deadline: the "
                    "attempt ran past its run deadline (the attempt's deadline_at)")


class LeaseGoneOut(Answer):
    error: LeaseGoneBody


REQUESTS: tuple[type[BaseModel], ...] = (AcquireIn, RenewIn, PhaseIn, ResultIn, FinishIn)
