"""Plain data of the domain: tasks, attempts, leases, result batches. No I/O."""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any


class State(enum.StrEnum):
    PENDING = "pending"
    LEASED = "leased"
    RUNNING = "running"
    RETRY_WAIT = "retry_wait"
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def active(self) -> bool:
        """Held by a worker: a lease is live."""
        return self in ACTIVE


TERMINAL = frozenset({State.COMPLETED, State.FAILED, State.TIMED_OUT, State.CANCELLED})
ACTIVE = frozenset({State.LEASED, State.RUNNING, State.CANCELLING})
QUEUED = frozenset({State.PENDING, State.RETRY_WAIT})


class Phase(enum.StrEnum):
    INITIALIZE = "initialize"
    PREPARE = "prepare"
    RUN = "run"
    STOP = "stop"


class AttemptStatus(enum.StrEnum):
    LEASED = "leased"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True, slots=True)
class TaskError:
    code: str
    message: str
    retryable: bool = True

    def to_json(self) -> dict[str, Any]:
        """As the store keeps it and events carry it (the API's TaskErrorOut reads the same two fields):
        `retryable` decided what happened next and is not shown."""
        return {"code": self.code, "message": self.message}


CANCELLED_ON_REQUEST = TaskError("cancelled", "cancelled on request", retryable=False)


def cancel_deadline_error(deadline_s: float) -> TaskError:
    """A cancel the reconciler finished because the worker did not answer it in time."""
    return TaskError("cancel_deadline", f"the worker did not stop within {deadline_s:g}s", retryable=False)


DEFAULT_ORGANIZATION = "default"
ORGANIZATION_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"  # an organization's name: what a submit, a filter and a worker take
FILE_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"    # an input's or an artifact's name: one path segment
SHA256_PATTERN = r"^[0-9a-f]{64}$"               # a blob's name: the lowercase hex SHA-256 of its bytes
_FILE_NAME = re.compile(FILE_NAME_PATTERN)


def file_name_error(name: object) -> str | None:
    """Why `name` cannot name an input or an artifact (it becomes a file of the workdir), else None."""
    if not isinstance(name, str) or not _FILE_NAME.match(name):
        return "must be 1 to 64 of A-Z a-z 0-9 . _ -"
    if name in {".", ".."}:
        return "must not be . or .."
    return None


@dataclass(frozen=True, slots=True)
class NewTask:
    """A validated submission, before the store gives it an id."""

    type: str
    payload: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    max_attempts: int = 3
    timeout_s: float | None = None
    required_tags: tuple[str, ...] = ()
    idempotency_key: str | None = None
    available_at: float | None = None
    organization: str = DEFAULT_ORGANIZATION  # which remote workers may see it (local workers serve every one)
    inputs: dict[str, str] = field(default_factory=dict)  # file name -> sha256 of a stored blob

    def fingerprint(self) -> str:
        """What makes two submits with one idempotency key "the same body": every field but the key, the
        time it may start included; "" without a key, as there is nothing to compare it with (hashing every
        task of a batch was a fifth of its insert)."""
        if self.idempotency_key is None:
            return ""
        body = [self.type, self.payload, self.priority, self.max_attempts, self.timeout_s,
                sorted(self.required_tags)]
        if self.available_at is not None:  # appended, so that bodies without one hash as they always have
            body.append(self.available_at)
        if self.organization != DEFAULT_ORGANIZATION:  # likewise: the default hashes as before it existed
            body.append(["organization", self.organization])
        if self.inputs:
            body.append(["inputs", self.inputs])
        return hashlib.sha256(canonical_json(body).encode()).hexdigest()


@dataclass(slots=True)  # hot path: plain is 4x cheaper to build than frozen; treat as immutable
class Attempt:
    id: str
    task_id: str
    number: int
    node_id: str
    worker_id: str
    status: AttemptStatus
    started_at: float
    finished_at: float | None = None
    error: TaskError | None = None
    exit_status: int | None = None
    stderr_tail: str | None = None
    # When its run phase started: its run timeout + execution.stop_timeout_s + one lease. Past it the store
    # refuses its writes (reason "deadline") and the reconciler ends it timed_out. None before its run phase.
    deadline_at: float | None = None


@dataclass(frozen=True, slots=True)
class ResultBatch:
    plugin: str
    sequence: int
    idempotency_key: str
    sha256: str
    final: bool
    payload: Any
    attempt_id: str = ""  # the attempt that emitted it
    # as record_result answers: whether that call stored it (False: it was found stored under its key)
    stored_now: bool = field(default=False, compare=False)


@dataclass(frozen=True, slots=True)
class Blob:
    """Immutable bytes, named by the lowercase hex SHA-256 of their content; stored whole and durable or not at all."""

    sha256: str
    size: int
    created_at: float


@dataclass(frozen=True, slots=True)
class Artifact:
    """A file an attempt recorded: one per (attempt, name), its bytes a blob."""

    name: str
    sha256: str
    size: int
    content_type: str | None
    attempt_id: str
    created_at: float


@dataclass(slots=True)  # hot path: plain is 4x cheaper to build than frozen; treat as immutable
class Task:
    id: str
    type: str
    payload: dict[str, Any]
    priority: int
    state: State
    phase: Phase | None
    progress: dict[str, Any] | None
    attempt: int
    max_attempts: int
    interruptions: int
    timeout_s: float | None
    required_tags: tuple[str, ...]
    idempotency_key: str | None
    node_id: str | None
    error: TaskError | None
    created_at: float
    updated_at: float
    available_at: float
    finished_at: float | None
    attempts: tuple[Attempt, ...] = ()
    results: tuple[ResultBatch, ...] = ()
    organization: str = DEFAULT_ORGANIZATION
    inputs: dict[str, str] = field(default_factory=dict)  # as submitted: file name -> sha256
    artifacts: tuple[Artifact, ...] = ()                   # every attempt's, oldest first (get only)


@dataclass(slots=True)  # hot path: plain is 4x cheaper to build than frozen; treat as immutable
class Lease:
    """The right to execute one attempt: every worker write is fenced by its attempt id and lease token."""

    task_id: str
    attempt_id: str
    token: str
    expires_at: float


@dataclass(slots=True)  # hot path: plain is 4x cheaper to build than frozen; treat as immutable
class Claimed:
    task: Task
    lease: Lease


@dataclass(frozen=True, slots=True)
class Worker:
    """Who claims: identifies the node, its process and the worker coroutine."""

    node_id: str
    instance_id: str
    worker_id: str


@dataclass(frozen=True, slots=True)
class ClaimFilter:
    """What this node can run: the names of the task types it claims (None: any type, as tools and tests
    claim), the tag sets of its free resource slots, and the organizations whose tasks it may take (None:
    any, as a node's local workers serve every organization; a remote worker takes only its own)."""

    types: tuple[str, ...] | None = None
    tag_sets: tuple[frozenset[str], ...] = ()
    organizations: tuple[str, ...] | None = None

    def accepts_type(self, task_type: str) -> bool:
        return self.types is None or task_type in self.types

    def accepts_organization(self, organization: str) -> bool:
        return self.organizations is None or organization in self.organizations

    def satisfies(self, required: tuple[str, ...]) -> bool:
        return not required or any(set(required) <= tags for tags in self.tag_sets)


@dataclass(slots=True)  # hot path: plain is 4x cheaper to build than frozen; immutable once posted
class Outcome:
    """How an attempt ended, as the engine reports it to the store."""

    status: AttemptStatus
    error: TaskError | None = None
    exit_status: int | None = None
    stderr_tail: str | None = None
    # The attempt's last progress report, written with its end: the lease keeper writes notes behind, so
    # the last one may not be in the store yet. None keeps what the store has.
    progress: dict[str, Any] | None = None
    # What the attempt's plugins put in ctx.scope, given with a success: a scan step's store merges it into
    # its scan's scope. Any other task's store ignores it.
    scope: dict[str, Any] | None = None


class WorkerState(enum.StrEnum):
    """A remote worker's standing in the registry: what the gateway does with its calls."""

    PENDING = "pending"    # an unknown identity under manual enrollment: refused until an operator enables it
    ENABLED = "enabled"    # served
    DISABLED = "disabled"  # drained: its running attempts go on, it is handed nothing new
    REVOKED = "revoked"    # final: its attempts are cancelled and its calls refused


@dataclass(frozen=True, slots=True)
class CertSeen:
    """A client certificate a worker presented: the lowercase hex SHA-256 of its DER form, its expiry, and
    its issuer (the SHA-256 fingerprint of the CA certificate that signed it)."""

    fingerprint: str
    not_after: float
    issuer: str = ""


@dataclass(frozen=True, slots=True)
class RemoteWorker:
    """One identity (its certificate's subject) in the gateway's registry. `live` counts its leased,
    running and cancelling attempts, computed when the record is read."""

    id: str
    state: WorkerState
    max_concurrent_tasks: int
    task_types: tuple[str, ...] = ("*",)                 # fnmatch globs of the task types it may take
    organizations: tuple[str, ...] = (DEFAULT_ORGANIZATION,)
    slots: tuple[tuple[str, ...], ...] = ()              # the tag set of each slot it last reported
    version: str | None = None                           # the tidepool version it last reported
    fingerprints: tuple[CertSeen, ...] = ()              # every certificate it has presented, oldest first
    first_seen: float = 0.0
    last_seen: float = 0.0
    address: str | None = None                           # where its last call came from
    live: int = 0
    issuer: str | None = None                            # the CA its identity is bound to (its first certificate's)
    tags: tuple[str, ...] = ("*",)                       # tag globs: the reported slots count only with these


@dataclass(frozen=True, slots=True)
class WorkerChange:
    """An operator's change of a worker's record; None leaves a field as it is. `state` is enabled or
    disabled (a revoke is a verb of its own). Taking organizations away cancels the worker's active attempts
    of the organizations it is not assigned after the change, unless `cancel_removed` is False (then they run
    to their end); `cancel_removed` True cancels them with no change of organizations too (also those an
    earlier change let run). `cancel_running` with the state disabled cancels every active attempt of it."""

    state: WorkerState | None = None
    max_concurrent_tasks: int | None = None
    task_types: tuple[str, ...] | None = None
    organizations: tuple[str, ...] | None = None
    cancel_removed: bool | None = None  # None: cancel when the change takes organizations away
    tags: tuple[str, ...] | None = None
    reset_issuer: bool = False  # the next certificate binds the identity to its CA anew
    cancel_running: bool = False  # with state disabled: the worker's active attempts are cancelled too


def canonical_json(value: Any) -> str:
    """Raises ValueError for NaN and infinities: JSON has no such numbers, and no answer could carry them."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_of(payload: Any) -> str:
    # surrogatepass: a payload a worker sent with a lone surrogate in it has a digest too (to be checked
    # against the one it sent); the store keeps it with U+FFFD instead, under that payload's digest.
    return hashlib.sha256(canonical_json(payload).encode("utf-8", "surrogatepass")).hexdigest()


def rfc3339(ts: float | None) -> str | None:
    """UTC with microseconds and a Z. Every event and task JSON carries several: the text of the
    current second is kept, so most calls only format the microseconds (2x faster than datetime)."""
    global _second
    if ts is None:
        return None
    whole = math.floor(ts)
    micro = round((ts - whole) * 1_000_000)
    if micro == 1_000_000:
        whole, micro = whole + 1, 0
    second = _second  # one read: another thread may replace it meanwhile
    if second[0] != whole:
        second = _second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
    return f"{second[1]}.{micro:06d}Z"


_second: tuple[int, str] = (0, "1970-01-01T00:00:00")


_id_lock = threading.Lock()
_id_last = (0, 0)


def new_id(now: float | None = None) -> str:
    """A sortable id: 48-bit milliseconds then 80 random bits, as 32 hex digits, monotonic within a
    millisecond (ULID's layout; hex because C formats it several times faster than base32)."""
    global _id_last
    ms = int((time.time() if now is None else now) * 1000)
    with _id_lock:
        last_ms, last_rand = _id_last
        if ms <= last_ms:
            ms, rand = last_ms, (last_rand + 1) & ((1 << 80) - 1)
        else:
            rand = int.from_bytes(os.urandom(10), "big")
        _id_last = (ms, rand)
    return f"{ms:012x}{rand:020x}"


def new_token() -> str:
    return os.urandom(16).hex()
