"""What every store decides alike about the remote workers of the registry: their first record, a later
contact, an operator's change, which organizations a change takes away, the room an acquire has, and
which task types a worker's globs allow.

A task type glob is an fnmatch pattern with only `*` (any run of characters) and `?` (any one): every
other character, `[` included, means itself, so the stores' SQL matches exactly what Python does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from ..errors import Conflict, InvalidRequest
from ..model import ORGANIZATION_PATTERN, CertSeen, ClaimFilter, RemoteWorker, WorkerChange, WorkerState
from .port import Enroll

ORGANIZATION = re.compile(ORGANIZATION_PATTERN)
MAX_ORGANIZATIONS = 256
MAX_TYPE_GLOBS = 256
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
                        address=address)


def met_again(worker: RemoteWorker, cert: CertSeen, address: str | None, now: float) -> RemoteWorker:
    """The record after a later contact: last seen now, from `address`, and `cert` kept if it is new."""
    seen = worker.fingerprints
    if all(c.fingerprint != cert.fingerprint for c in seen):
        seen = (*seen, cert)
    return dataclasses.replace(worker, last_seen=max(worker.last_seen, now), address=address, fingerprints=seen)


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
        fields["task_types"] = _type_globs(change.task_types)
    if change.organizations is not None:
        fields["organizations"] = _organizations(change.organizations)
    return dataclasses.replace(worker, **fields)  # type: ignore[arg-type]


def _type_globs(globs: Sequence[str]) -> tuple[str, ...]:
    if len(globs) > MAX_TYPE_GLOBS:
        raise InvalidRequest("task_types", f"{len(globs)} globs; at most {MAX_TYPE_GLOBS}")
    for glob in globs:
        if not 1 <= len(glob) <= 200:
            raise InvalidRequest("task_types", f"{glob!r}: a glob is 1 to 200 characters")
    return tuple(dict.fromkeys(globs))


def _organizations(names: Sequence[str]) -> tuple[str, ...]:
    if len(names) > MAX_ORGANIZATIONS:
        raise InvalidRequest("organizations", f"{len(names)} organizations; at most {MAX_ORGANIZATIONS}")
    return tuple(dict.fromkeys(check_organization("organizations", n) for n in names))


def spared(after: RemoteWorker, change: WorkerChange) -> tuple[str, ...] | None:
    """When a change says cancel_removed, the organizations whose active attempts it leaves be: the worker's
    assignment after it, so that the attempts of every other organization are cancelled, also of those an
    earlier change took away; None when it cancels nothing."""
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
    organizations, the requested tag sets), and the globs the store must still match in its query when
    the request named no types (None: nothing left to match)."""
    organizations = worker.organizations
    if where.types is not None:
        allowed = tuple(t for t in where.types if any(glob_matches(g, t) for g in worker.task_types))
        return ClaimFilter(allowed, where.tag_sets, organizations), None
    if "*" in worker.task_types:
        return ClaimFilter(None, where.tag_sets, organizations), None
    return ClaimFilter(None, where.tag_sets, organizations), worker.task_types


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
