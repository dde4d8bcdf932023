"""The one exception tree of tidepool.

    TidepoolError
    ├── ConfigError              a setting is missing, unknown or inconsistent (exit 2)
    ├── InvalidTransition        the lifecycle table forbids this move (nothing changed)
    ├── InvalidRequest           a submission names an unknown type or unserviceable tags (HTTP 400)
    │   ├── OutOfScope           a payload field names a target outside its plugin's scope (HTTP 400 out_of_scope)
    │   └── DigestMismatch       bytes whose sha256 is not the one named (HTTP 400 digest_mismatch, nothing stored)
    ├── WorkerRefused            the registry refuses a remote worker's call (HTTP 403: worker_pending, ...)
    ├── LeaseGone                a remote worker's write behind a lease it no longer holds (HTTP 410 lease_lost)
    ├── StoreError
    │   ├── StoreUnavailable     the store cannot be reached; retry later (HTTP 503, exit 3)
    │   ├── SchemaMismatch       the store's schema is newer than this tidepool, or older and not migrated (exit 1)
    │   ├── TaskNotFound         no task with this id (HTTP 404)
    │   ├── ScheduleNotFound     no schedule with this name (HTTP 404)
    │   ├── ScanNotFound         no scan with this id (HTTP 404)
    │   ├── WorkerNotFound       no remote worker with this identity in the registry (HTTP 404)
    │   ├── BlobNotFound         no blob with this sha256 (HTTP 404)
    │   ├── BlobTooLarge         a blob past artifacts.max_blob_bytes (HTTP 413 blob_too_large)
    │   ├── Conflict             a write contradicts an earlier one (HTTP 409)
    │   │   └── IssuerConflict   a certificate of another CA than the one its identity is bound to
    │   ├── QueueFull            pending + retry_wait is at pool.max_queued (HTTP 429)
    │   ├── RemoteNode           this node is a remote worker: the queue lives on its gateway (HTTP 409)
    │   ├── ValueRefused         the store cannot keep this value as it is (HTTP 422, never retried as an outage)
    │   ├── QuotaExceeded        an attempt wrote past a quota (HTTP 413 result_quota, artifact_quota)
    │   └── LeaseLost            the attempt's lease is stale, expired or taken over
    │       ├── TaskCancelling   the lease ended because a cancel was committed
    │       └── DeadlinePassed   the attempt ran past its run deadline: the store takes nothing more of it
    └── PluginError              a plugin failed; `code` says how, `retryable` whether to try again
        ├── InvalidArgument      a template value was refused before anything ran (not retried)
        ├── LimitExceeded        a plugin breached memory_mb, cpu_s, nofile, disk_mb or max_blob_bytes (stdout)
        └── TargetRefused        a target outside the plugin's scope, found before anything reached it
"""

from __future__ import annotations


class TidepoolError(Exception):
    """Base of every error tidepool raises on purpose. One the API answers on purpose carries its HTTP status
    and the `code` of its JSON body; None: a request that meets it is a server error."""

    http_status: int | None = None
    code = "internal_error"


class ConfigError(TidepoolError):
    """The configuration is invalid; the message names the key."""


class InvalidTransition(TidepoolError):
    def __init__(self, state: str, event: str) -> None:
        super().__init__(f"no transition from state {state!r} on {event!r}")
        self.state = state
        self.event = event


class InvalidRequest(TidepoolError):
    http_status, code = 400, "invalid_request"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class OutOfScope(InvalidRequest):
    """A payload field names a target outside the CIDRs its plugin may reach: refused before anything is queued."""

    code = "out_of_scope"


class WorkerRefused(TidepoolError):
    """The gateway's registry does not serve this identity; `code` says why."""

    http_status = 403

    def __init__(self, identity: str, code: str, message: str) -> None:
        super().__init__(f"worker {identity}: {message}")
        self.identity = identity
        self.code = code


class LeaseGone(TidepoolError):
    """A remote worker wrote behind a lease it does not hold; `reason`: expired, cancelled, revoked or
    superseded."""

    http_status, code = 410, "lease_lost"

    def __init__(self, subject: str, reason: str) -> None:
        super().__init__(f"{subject}: lease lost ({reason})")
        self.reason = reason


class StoreError(TidepoolError):
    """Base of the errors a store adapter raises."""


class StoreUnavailable(StoreError):
    http_status, code = 503, "store_unavailable"


class SchemaMismatch(StoreError):
    """The store answered, with a schema this tidepool cannot use as it is: retrying will not help."""


class TaskNotFound(StoreError):
    http_status, code = 404, "not_found"

    def __init__(self, task_id: str) -> None:
        super().__init__(f"task {task_id} not found")
        self.task_id = task_id


class ScheduleNotFound(StoreError):
    http_status, code = 404, "not_found"

    def __init__(self, name: str) -> None:
        super().__init__(f"schedule {name!r} not found")
        self.name = name


class ScanNotFound(StoreError):
    http_status, code = 404, "scan_not_found"

    def __init__(self, scan_id: str) -> None:
        super().__init__(f"scan {scan_id} not found")
        self.scan_id = scan_id


class WorkerNotFound(StoreError):
    http_status, code = 404, "worker_not_found"

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"worker {worker_id!r} not found")
        self.worker_id = worker_id


class BlobNotFound(StoreError):
    http_status, code = 404, "blob_not_found"

    def __init__(self, sha256: str) -> None:
        super().__init__(f"blob {sha256} not found")
        self.sha256 = sha256


class DigestMismatch(InvalidRequest):
    """Bytes whose SHA-256 is not the one their sender named: nothing was stored."""

    code = "digest_mismatch"

    def __init__(self, expected: str, actual: str, field: str = "X-Content-SHA256") -> None:
        super().__init__(field, f"the body's sha256 is {actual}, not {expected}; nothing was stored")


class BlobTooLarge(StoreError):
    """A blob past [artifacts] max_blob_bytes: nothing was stored."""

    http_status, code = 413, "blob_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"a blob may hold at most {limit} bytes ([artifacts] max_blob_bytes); nothing was stored")
        self.limit = limit


class Conflict(StoreError):
    http_status, code = 409, "conflict"


class IssuerConflict(Conflict):
    """A certificate for a known identity signed by another CA than the one the identity is bound to."""

    def __init__(self, identity: str, bound: str, presented: str) -> None:
        self.identity, self.bound, self.presented = identity, bound, presented
        super().__init__(f"worker {identity}: {self.explained()}")

    def explained(self) -> str:
        return (f"its identity is bound to the CA {self.bound[:16]}..., this certificate is of the CA "
                f"{self.presented[:16] or 'unknown'}...; if the CA changed on purpose, an operator lets it bind anew "
                f"(tidepool workers set {self.identity} --reset-issuer)")


class QueueFull(StoreError):
    http_status, code = 429, "queue_full"


class RemoteNode(StoreError):
    http_status, code = 409, "remote_worker"

    def __init__(self, gateway_url: str) -> None:
        super().__init__(f"this node is a remote worker: its tasks and schedules live on its gateway, {gateway_url}; "
                         "ask the gateway")
        self.gateway_url = gateway_url


class ValueRefused(StoreError):
    """The store refused a value (text it cannot encode, a number past its range): writing it again would be
    refused again, so a caller must never retry it as though the store were away."""

    http_status, code = 422, "value_refused"


class QuotaExceeded(StoreError):
    """An attempt wrote past its quota; `code` names which (result_quota). Nothing changed and the attempt
    may still finish."""

    http_status = 413

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class LeaseLost(StoreError):
    reason = "expired"  # why, as the worker protocol's 410 lease_lost says it

    def __init__(self, task_id: str, attempt_id: str, why: str = "lease is stale or expired") -> None:
        super().__init__(f"task {task_id} attempt {attempt_id}: {why}")
        self.task_id = task_id
        self.attempt_id = attempt_id


class TaskCancelling(LeaseLost):
    reason = "cancelled"

    def __init__(self, task_id: str, attempt_id: str) -> None:
        super().__init__(task_id, attempt_id, "cancel requested")


class DeadlinePassed(LeaseLost):
    """The attempt is past its run deadline (its run timeout, the stop phase's bound and one lease after its run
    phase started): the store refuses its renewals and writes, and the reconciler ends it timed_out."""

    reason = "deadline"

    def __init__(self, task_id: str, attempt_id: str) -> None:
        super().__init__(task_id, attempt_id, "past its run deadline; the reconciler ends it timed_out")


class PluginError(TidepoolError):
    """A plugin failed. `code` goes into the task's error; `retryable` decides retry vs failed."""

    code = "plugin_error"
    retryable = True

    def __init__(self, message: str, *, code: str | None = None, retryable: bool | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable


class InvalidArgument(PluginError):
    code = "invalid_argument"
    retryable = False

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class LimitExceeded(PluginError):
    code = "limit_exceeded"

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"{limit} exceeded: {message}")
        self.limit = limit


class TargetRefused(PluginError):
    """A target outside its plugin's scope (or a name whose addresses are unknown), found before the plugin
    reached it. Not retried, but for a resolver that failed for now (retryable then)."""

    code = "out_of_scope"
    retryable = False

    def __init__(self, field: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(f"{field}: {message}", retryable=retryable)
        self.field = field
