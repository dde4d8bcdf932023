"""The columns both adapters read, and their rows as model objects.

A row is a sequence in the order of its column list. Where the adapters store a value differently (a tag
list is a PostgreSQL array but JSON text in SQLite), the function takes that value already decoded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .. import schedules
from ..lifecycle import Event, step
from ..model import (
    Attempt,
    AttemptStatus,
    CertSeen,
    Phase,
    RemoteWorker,
    ResultBatch,
    State,
    Task,
    TaskError,
    WorkerState,
)
from ..schedules import Schedule
from .port import Node

# The schema both adapters build, step by step: 1 tasks, attempts and results; 2 schedules; 3 nodes; 4 remote
# workers and the tasks' organizations.
SCHEMA_VERSION = 4

TASK_COLUMNS = ("id, type, payload, priority, state, phase, progress, attempt, max_attempts, interruptions, "
                "timeout_s, required_tags, idempotency_key, node_id, error, created_at, updated_at, "
                "available_at, finished_at, organization")
ATTEMPT_COLUMNS = ("id, task_id, number, node_id, worker_id, status, started_at, finished_at, error, exit_status, "
                   "stderr_tail")
RESULT_COLUMNS = "plugin, sequence, idempotency_key, sha256, final, payload, attempt_id"
SCHEDULE_COLUMNS = "name, spec, paused, next_tick_at, next_run_at, last_run_at, last_task_id"
NODE_COLUMNS = ("node_id, instance_id, hostname, pid, version, started_at, heartbeat_at, heartbeat_s, stopped_at, "
                "task_types, tags, max_workers")
WORKER_COLUMNS = ("id, state, max_concurrent_tasks, task_types, organizations, slots, version, fingerprints, "
                  "first_seen, last_seen, address")


def loads(text: str) -> Any:
    # Most payloads and tag lists of a busy queue are empty; skip the parser for them.
    if text == "{}":
        return {}
    return [] if text == "[]" else json.loads(text)


def error_of(text: str) -> TaskError:
    data = json.loads(text)
    return TaskError(data["code"], data["message"])


def error_text(err: TaskError | None) -> str | None:
    return None if err is None else json.dumps(err.to_json())


def task_of(row: Sequence[Any], *, required_tags: Sequence[str], attempts: tuple[Attempt, ...] = (),
         leased_by: str | None = None, now: float | None = None) -> Task:
    """A Task from a TASK_COLUMNS row; with leased_by, as it reads once that node's claim of it commits."""
    state, attempt, node_id, updated_at = State(row[4]), row[7], row[13], row[16]
    if leased_by is not None:
        state, attempt, node_id, updated_at = step(state, Event.CLAIM), attempt + 1, leased_by, now
    return Task(
        id=row[0], type=row[1], payload=loads(row[2]), priority=row[3], state=state,
        phase=None if row[5] is None or leased_by else Phase(row[5]),
        progress=None if row[6] is None or leased_by else json.loads(row[6]),
        attempt=attempt, max_attempts=row[8], interruptions=row[9], timeout_s=row[10],
        required_tags=tuple(required_tags), idempotency_key=row[12], node_id=node_id,
        error=None if row[14] is None or leased_by else error_of(row[14]), created_at=row[15],
        updated_at=updated_at, available_at=row[17], finished_at=row[18], attempts=attempts, organization=row[19],
    )


def attempt_of(r: Sequence[Any]) -> Attempt:
    """An Attempt from an ATTEMPT_COLUMNS row."""
    err = None if r[8] is None else error_of(r[8])
    return Attempt(r[0], r[1], r[2], r[3], r[4], AttemptStatus(r[5]), r[6], r[7], err, r[9], r[10])


def result_of(row: Sequence[Any]) -> ResultBatch:
    """A ResultBatch from a RESULT_COLUMNS row."""
    return ResultBatch(row[0], row[1], row[2], row[3], bool(row[4]), json.loads(row[5]), row[6])


def schedule_of(row: Sequence[Any]) -> Schedule:
    """A Schedule from a SCHEDULE_COLUMNS row."""
    return Schedule(row[0], **schedules.stored_spec(row[1]), paused=bool(row[2]), next_tick_at=row[3],
                    next_run_at=row[4], last_run_at=row[5], last_task_id=row[6])


def schedule_values(s: Schedule) -> tuple[Any, ...]:
    """A schedule's SCHEDULE_COLUMNS values."""
    return (s.name, json.dumps(schedules.spec_of(s)), s.paused, s.next_tick_at, s.next_run_at, s.last_run_at,
            s.last_task_id)


def node_of(row: Sequence[Any], *, task_types: Sequence[str]) -> Node:
    """A Node from a NODE_COLUMNS row; its tags are JSON text in both stores."""
    tags = tuple(tuple(t) for t in json.loads(row[10]))
    return Node(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], tuple(task_types), tags, row[11],
                stopped_at=row[8])


def node_values(n: Node, *, task_types: Any) -> tuple[Any, ...]:
    """A node's NODE_COLUMNS values, with its task types as the store keeps them."""
    return (n.node_id, n.instance_id, n.hostname, n.pid, n.version, n.started_at, n.heartbeat_at, n.heartbeat_s,
            n.stopped_at, task_types, json.dumps([list(t) for t in n.tags]), n.max_workers)


def worker_of(row: Sequence[Any], *, task_types: Sequence[str], organizations: Sequence[str],
              live: int) -> RemoteWorker:
    """A RemoteWorker from a WORKER_COLUMNS row; its slots and fingerprints are JSON text in both stores."""
    slots = tuple(tuple(s) for s in json.loads(row[5]))
    seen = tuple(CertSeen(c["fingerprint"], c["not_after"]) for c in json.loads(row[7]))
    return RemoteWorker(row[0], WorkerState(row[1]), row[2], tuple(task_types), tuple(organizations), slots, row[6],
                        seen, row[8], row[9], row[10], live)


def worker_values(w: RemoteWorker, *, lists: Callable[[tuple[str, ...]], Any]) -> tuple[Any, ...]:
    """A worker's WORKER_COLUMNS values; `lists` makes its task types and organizations what the store keeps."""
    seen = json.dumps([{"fingerprint": c.fingerprint, "not_after": c.not_after} for c in w.fingerprints])
    return (w.id, w.state.value, w.max_concurrent_tasks, lists(w.task_types), lists(w.organizations),
            json.dumps([list(s) for s in w.slots]), w.version, seen, w.first_seen, w.last_seen, w.address)
