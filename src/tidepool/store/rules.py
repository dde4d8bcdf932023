"""The rules every store adapter decides alike: room checks, cancel and retry steps, expiry outcomes, who may
end an attempt, the state sets their SQL names (rendered from the model), and the remote workers of the
registry: their first record, a later contact (the CA its identity is bound to), an operator's change, which
attempts a change cancels, the room an acquire has, which task types a worker's globs allow and which of the
tags it reports its record lets count.

A task type glob is an fnmatch pattern with only `*` (any run of characters) and `?` (any one): every
other character, `[` included, means itself, so the stores' SQL matches exactly what Python does.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from ..errors import Conflict, InvalidRequest, InvalidTransition, IssuerConflict, QueueFull, TidepoolError
from ..lifecycle import Event, RetryPolicy, step
from ..model import (
    ACTIVE,
    ORGANIZATION_PATTERN,
    QUEUED,
    TERMINAL,
    AttemptStatus,
    CertSeen,
    ClaimFilter,
    Lease,
    NewTask,
    Outcome,
    RemoteWorker,
    State,
    TaskError,
    WorkerChange,
    WorkerState,
    file_name_error,
)
from .port import Ending, Enroll, WorkerPort


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


# files in and out of tasks

def check_inputs(inputs: Mapping[str, str], known: Collection[str]) -> None:
    """InvalidRequest naming the first input whose blob is not among `known`: a submit naming it queues nothing."""
    for name, sha256 in inputs.items():
        if sha256 not in known:
            raise InvalidRequest(f"inputs.{name}", f"no blob {sha256}; upload it first (POST /v1/blobs)")


def check_artifact_name(name: str) -> None:
    """InvalidRequest (field `name`) for a name that is not one path segment: it becomes a file of a workdir."""
    error = file_name_error(name)
    if error is not None:
        raise InvalidRequest("name", f"artifact name {name!r} {error}")


def artifact_taken(lease: Lease, name: str, recorded_sha256: str) -> Conflict:
    """An attempt's artifact `name` offered again with other bytes than it was recorded with."""
    return Conflict(f"task {lease.task_id} attempt {lease.attempt_id}: artifact {name!r} was recorded with sha256 "
                    f"{recorded_sha256}")


def step_inputs(scan_inputs: Mapping[str, str], earlier: Iterable[Iterable[tuple[str, str]]]) -> dict[str, str]:
    """A scan step's task's inputs: the scan's, then each earlier job's artifacts (name, sha256) in job order,
    a later one of the same name winning, so a step reads what the steps before it wrote."""
    inputs = dict(scan_inputs)
    for artifacts in earlier:
        inputs.update(artifacts)
    return inputs


# the worker registry

ORGANIZATION = re.compile(ORGANIZATION_PATTERN)
MAX_ORGANIZATIONS = 256
MAX_GLOBS = 256  # of a record's task_types, and of its tags
MAX_CONCURRENT_TASKS = 100_000
REMOTE_INSTANCE = "remote"  # the instance id of a remote worker's attempts: the store never knows its process


def node_taken(identity: str) -> Conflict:
    """A worker identity that is the id of a node of the fleet: their attempts could not be told apart."""
    return Conflict(f"worker identity {identity!r} is the node id of a node of this fleet; give the worker's "
                    "certificate another name")


def check_organization(field: str, value: str) -> str:
    """`value` if it is an organization name (1-64 of A-Z a-z 0-9 . _ -), else InvalidRequest naming `field`."""
    if not ORGANIZATION.fullmatch(value):
        raise InvalidRequest(field, f"{value!r} is not an organization name: 1 to 64 of the characters "
                                    "A-Z a-z 0-9 . _ -")
    return value


def first_record(identity: str, cert: CertSeen, address: str | None, now: float, enroll: Enroll,
                 max_concurrent_tasks: int) -> RemoteWorker:
    """The record of an identity met for the first time."""
    state = WorkerState.ENABLED if enroll == "auto" else WorkerState.PENDING
    return RemoteWorker(identity, state, max_concurrent_tasks, fingerprints=(cert,), first_seen=now, last_seen=now,
                        address=address, issuer=cert.issuer or None)


def met_again(worker: RemoteWorker, cert: CertSeen, address: str | None, now: float) -> RemoteWorker:
    """The record after a later contact: last seen now, from `address`, and `cert` kept if it is new.
    IssuerConflict, the record unchanged, for a certificate of another CA than the one the identity is bound
    to: whoever holds a key of another CA the gateway trusts must not become this worker. A record bound to
    no CA yet (new, or reset by an operator) is bound to this certificate's."""
    if worker.issuer is not None and cert.issuer != worker.issuer:
        raise IssuerConflict(worker.id, worker.issuer, cert.issuer)
    seen = worker.fingerprints
    if all(c.fingerprint != cert.fingerprint for c in seen):
        seen = (*seen, cert)
    return dataclasses.replace(worker, last_seen=max(worker.last_seen, now), address=address, fingerprints=seen,
                               issuer=worker.issuer or cert.issuer or None)


def changed(worker: RemoteWorker, change: WorkerChange) -> RemoteWorker:
    """The record after an operator's change. Conflict on a revoked worker; InvalidRequest naming the field
    of a bad value. Nothing is written by the caller when either is raised."""
    if worker.state is WorkerState.REVOKED:
        raise Conflict(f"worker {worker.id} is revoked; a revoke is final")
    fields: dict[str, object] = {}
    if change.state is not None:
        if change.state not in (WorkerState.ENABLED, WorkerState.DISABLED):
            raise InvalidRequest("state", f"{change.state.value!r}: a worker is set enabled or disabled (revoke "
                                          "it with its revoke call)")
        fields["state"] = change.state
    if change.max_concurrent_tasks is not None:
        if not 0 <= change.max_concurrent_tasks <= MAX_CONCURRENT_TASKS:
            raise InvalidRequest("max_concurrent_tasks", f"{change.max_concurrent_tasks}: must lie between 0 "
                                                         f"and {MAX_CONCURRENT_TASKS}")
        fields["max_concurrent_tasks"] = change.max_concurrent_tasks
    if change.task_types is not None:
        fields["task_types"] = _globs("task_types", change.task_types)
    if change.organizations is not None:
        fields["organizations"] = _organizations(change.organizations)
    if change.tags is not None:
        fields["tags"] = _globs("tags", change.tags)
    if change.reset_issuer:
        fields["issuer"] = None
    after = dataclasses.replace(worker, **fields)  # type: ignore[arg-type]
    if change.cancel_running and after.state is not WorkerState.DISABLED:
        raise InvalidRequest("cancel_running", "cancels the running attempts of a drain: give it with state "
                                               "disabled")
    return after


def _globs(field: str, globs: Sequence[str]) -> tuple[str, ...]:
    """A record's globs as the operator gave them, each once: `field` names them in a refusal."""
    if len(globs) > MAX_GLOBS:
        raise InvalidRequest(field, f"{len(globs)} globs; at most {MAX_GLOBS}")
    for glob in globs:
        if not 1 <= len(glob) <= 200:
            raise InvalidRequest(field, f"{glob!r}: a glob is 1 to 200 characters")
    return tuple(dict.fromkeys(globs))


def _organizations(names: Sequence[str]) -> tuple[str, ...]:
    if len(names) > MAX_ORGANIZATIONS:
        raise InvalidRequest("organizations", f"{len(names)} organizations; at most {MAX_ORGANIZATIONS}")
    return tuple(dict.fromkeys(check_organization("organizations", n) for n in names))


def spared(after: RemoteWorker, change: WorkerChange) -> tuple[str, ...] | None:
    """The organizations whose active attempts a change leaves be, the worker's other active attempts being
    cancelled: none (every attempt is cancelled) for a disable with cancel_running; the worker's assignment
    after the change when it takes organizations away (unless it says cancel_removed False) or says
    cancel_removed, so that the attempts of every other organization are cancelled, also of those an earlier
    change let run. None when it cancels nothing: taking work away cancels it unless the operator says not to."""
    if change.cancel_running:
        return ()
    if change.cancel_removed is None and change.organizations is not None:
        return after.organizations
    return after.organizations if change.cancel_removed else None


SEEN_EVERY_S = 1.0  # an acquire saves a last_seen this much newer than the saved one, not every one


def reported(known: RemoteWorker, slots: Sequence[Sequence[str]], version: str | None, now: float) -> RemoteWorker:
    """The record as an acquire finds it: the slots and version the worker reports, seen now."""
    return dataclasses.replace(known, slots=tuple(tuple(s) for s in slots), version=version,
                               last_seen=max(known.last_seen, now))


def worth_saving(known: RemoteWorker, seen: RemoteWorker) -> bool:
    """Whether an acquire writes the worker's record: when what it reports changed, or its saved last_seen is
    SEEN_EVERY_S old. Acquires come many a second from a busy worker, and a write each would cost more
    than the lease it makes; a last seen a second behind tells an operator the same."""
    return (seen.slots != known.slots or seen.version != known.version
            or seen.last_seen - known.last_seen >= SEEN_EVERY_S)


def allowed_slots(worker: RemoteWorker, slots: Iterable[Iterable[str]]) -> tuple[frozenset[str], ...]:
    """Each slot a worker reports with only the tags its record's globs allow: what a worker says of itself
    is a claim, and the operator's globs decide which of its tags count."""
    if "*" in worker.tags:
        return tuple(frozenset(s) for s in slots)
    return tuple(frozenset(t for t in s if any(glob_matches(g, t) for g in worker.tags)) for s in slots)


def room(worker: RemoteWorker, limit: int) -> int:
    """How many tasks an acquire may lease: none unless the worker is enabled, never past its cap."""
    if worker.state is not WorkerState.ENABLED:
        return 0
    return max(0, min(limit, worker.max_concurrent_tasks - worker.live))


def glob_matches(glob: str, name: str) -> bool:
    return _python_regex(glob).fullmatch(name) is not None


def _python_regex(glob: str) -> re.Pattern[str]:
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in glob), re.DOTALL)


def acquire_filter(where: ClaimFilter, worker: RemoteWorker) -> tuple[ClaimFilter, tuple[str, ...] | None]:
    """What an acquire of `worker` may lease: the filter (the requested types its globs allow, its
    organizations, the requested tag sets with only the tags its record allows), and the globs the store must
    still match in its query when the request named no types (None: nothing left to match)."""
    organizations, tag_sets = worker.organizations, allowed_slots(worker, where.tag_sets)
    if where.types is not None:
        allowed = tuple(t for t in where.types if any(glob_matches(g, t) for g in worker.task_types))
        return ClaimFilter(allowed, tag_sets, organizations), None
    if "*" in worker.task_types:
        return ClaimFilter(None, tag_sets, organizations), None
    return ClaimFilter(None, tag_sets, organizations), worker.task_types


def postgres_regex(glob: str) -> str:
    """An anchored PostgreSQL regex matching what `glob` matches: a backslash makes an ASCII character other
    than a letter or digit literal."""
    def one(c: str) -> str:
        if c == "*":
            return ".*"
        if c == "?":
            return "."
        return c if c.isalnum() or not c.isascii() else "\\" + c
    return "^" + "".join(one(c) for c in glob) + "$"


def sqlite_glob(glob: str) -> str:
    """`glob` as SQLite's GLOB operator reads it: there `[` opens a set, so it is written as the set `[[]`."""
    return glob.replace("[", "[[]")
