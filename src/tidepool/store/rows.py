"""The columns both adapters read, and their rows as model objects.

A row is a sequence in the order of its column list. Where the adapters store a value differently (a tag
list is a PostgreSQL array but JSON text in SQLite), the function takes that value already decoded.

A scan row is SCAN_COLUMNS; a job row JOB_COLUMNS followed by its task's state, attempts started and error
(a LEFT JOIN: NULL once the task is pruned). A scan step's task row names its scan, job index and retry
number (tasks.scan_id, scan_index, scan_retry), so the transaction that ends it finds its scan. A scan's
payload and scope, and its steps' task payloads, are stored as the compact JSON their bounds are measured
in (canonical_json), not json.dumps' default, whose escapes and spaces would store more.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import schedules
from ..lifecycle import Event, step
from ..model import (
    Artifact,
    Attempt,
    AttemptStatus,
    CertSeen,
    NewTask,
    Phase,
    RemoteWorker,
    ResultBatch,
    State,
    Task,
    TaskError,
    WorkerState,
    canonical_json,
)
from ..scans import (
    Job,
    JobState,
    NewScan,
    Plan,
    Scan,
    ScanState,
    StepSpec,
    merge_scope,
    plan,
    shown,
    shown_scan,
    step_task,
)
from ..schedules import Schedule
from .port import Node, ScanMove

# The schema both adapters build, step by step: 1 tasks, attempts and results; 2 schedules; 3 nodes; 4 remote
# workers and the tasks' organizations; 5 scans; 6 what a gateway that does not trust its workers keeps; 7 blobs,
# the tasks' inputs and their artifacts.
SCHEMA_VERSION = 7

TASK_COLUMNS = ("id, type, payload, priority, state, phase, progress, attempt, max_attempts, interruptions, "
                "timeout_s, required_tags, idempotency_key, node_id, error, created_at, updated_at, "
                "available_at, finished_at, organization, inputs")
TASK_WIDTH = len(TASK_COLUMNS.split(", "))  # where what a query selects after a task's columns starts
ARTIFACT_COLUMNS = "name, sha256, size, content_type, attempt_id, created_at"
ATTEMPT_COLUMNS = ("id, task_id, number, node_id, worker_id, status, started_at, finished_at, error, exit_status, "
                   "stderr_tail, deadline_at")
RESULT_COLUMNS = "plugin, sequence, idempotency_key, sha256, final, payload, attempt_id"
SCHEDULE_COLUMNS = "name, spec, paused, next_tick_at, next_run_at, last_run_at, last_task_id"
NODE_COLUMNS = ("node_id, instance_id, hostname, pid, version, started_at, heartbeat_at, heartbeat_s, stopped_at, "
                "task_types, tags, max_workers")
WORKER_COLUMNS = ("id, state, max_concurrent_tasks, task_types, organizations, slots, version, fingerprints, "
                  "first_seen, last_seen, address, issuer, tags")


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
        inputs=loads(row[20]),
    )


def attempt_of(r: Sequence[Any]) -> Attempt:
    """An Attempt from an ATTEMPT_COLUMNS row."""
    err = None if r[8] is None else error_of(r[8])
    return Attempt(r[0], r[1], r[2], r[3], r[4], AttemptStatus(r[5]), r[6], r[7], err, r[9], r[10], r[11])


def artifact_of(row: Sequence[Any]) -> Artifact:
    """An Artifact from an ARTIFACT_COLUMNS row."""
    return Artifact(row[0], row[1], row[2], row[3], row[4], row[5])


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


def worker_of(row: Sequence[Any], *, task_types: Sequence[str], organizations: Sequence[str], tags: Sequence[str],
              live: int) -> RemoteWorker:
    """A RemoteWorker from a WORKER_COLUMNS row; its slots and fingerprints are JSON text in both stores."""
    slots = tuple(tuple(s) for s in json.loads(row[5]))
    seen = tuple(CertSeen(c["fingerprint"], c["not_after"], c.get("issuer", "")) for c in json.loads(row[7]))
    return RemoteWorker(row[0], WorkerState(row[1]), row[2], tuple(task_types), tuple(organizations), slots, row[6],
                        seen, row[8], row[9], row[10], live, row[11], tuple(tags))


def worker_values(w: RemoteWorker, *, lists: Callable[[tuple[str, ...]], Any]) -> tuple[Any, ...]:
    """A worker's WORKER_COLUMNS values; `lists` makes its task types, organizations and tags what the store
    keeps."""
    seen = json.dumps([{"fingerprint": c.fingerprint, "not_after": c.not_after, "issuer": c.issuer}
                       for c in w.fingerprints])
    return (w.id, w.state.value, w.max_concurrent_tasks, lists(w.task_types), lists(w.organizations),
            json.dumps([list(s) for s in w.slots]), w.version, seen, w.first_seen, w.last_seen, w.address, w.issuer,
            lists(w.tags))


# scans: their rows, and what a scan's next move writes, decided alike for both SQL adapters

SCAN_COLUMNS = ("id, profile, state, organization, payload, scope, priority, continue_on_failure, idempotency_key, "
                "created_at, updated_at, finished_at, cancel_requested_at")
JOB_COLUMNS = "scan_id, idx, step, state, task_id, tasks, scope_before"


def scan_values(scan_id: str, new: NewScan, now: float) -> tuple[Any, ...]:
    """A new scan's row: SCAN_COLUMNS, then its fingerprint."""
    return (scan_id, new.profile, ScanState.RUNNING.value, new.organization, canonical_json(new.payload), "{}",
            new.priority, new.continue_on_failure, new.idempotency_key, now, now, None, None, new.fingerprint())


def job_values(scan_id: str, new: NewScan) -> list[tuple[Any, ...]]:
    """A new scan's job rows: (scan_id, idx, step), each waiting."""
    return [(scan_id, i, json.dumps(s.to_json())) for i, s in enumerate(new.steps)]


def job_of(row: Sequence[Any]) -> Job:
    """A Job from a JOB_COLUMNS row and its task's (state, attempts started, error)."""
    task_state = None if row[7] is None else State(row[7])
    return Job(row[1], json.loads(row[2])["type"], shown(JobState(row[3]), task_state), row[4],
               row[8] or 0, None if row[9] is None else error_of(row[9]), row[5])


def scan_of(row: Sequence[Any], jobs: Sequence[Sequence[Any]]) -> Scan:
    """A Scan from a SCAN_COLUMNS row and its job rows, in index order."""
    shown_jobs = tuple(job_of(j) for j in jobs)
    return Scan(row[0], row[1], shown_scan(ScanState(row[2]), shown_jobs), row[3], loads(row[4]), loads(row[5]),
                row[6], bool(row[7]), row[8], shown_jobs, row[9], row[10], row[11], row[12])


@dataclass(frozen=True, slots=True)
class Stored:
    """A scan as its next move needs it: its row and its jobs' rows (with their tasks' states)."""

    row: Sequence[Any]
    jobs: Sequence[Sequence[Any]]

    @property
    def id(self) -> str:
        return str(self.row[0])

    @property
    def running(self) -> bool:
        return bool(self.row[2] == ScanState.RUNNING)

    def states(self) -> list[JobState]:
        return [JobState(j[3]) for j in self.jobs]

    def started(self) -> int | None:
        """The index of the job whose task is live (or ended without its end applied), if one is."""
        return next((j[1] for j in self.jobs if j[3] == JobState.STARTED), None)

    def scope(self) -> dict[str, Any]:
        return dict(loads(self.row[5]))

    def is_current(self, index: int, task_id: str) -> bool:
        """Whether `task_id` is job `index`'s live task in this running scan (not a stale one)."""
        job = self.jobs[index]
        return self.running and job[3] == JobState.STARTED and job[4] == task_id


@dataclass(frozen=True, slots=True)
class Writes:
    """What a store writes for a scan's move, in one transaction."""

    jobs: list[tuple[int, JobState]]      # job states that change (a started job's is written with its task)
    start: tuple[int, NewTask, str, int] | None  # (index, its task, the scope before it as JSON, retry number)
    state: ScanState
    scope: str
    finished_at: float | None
    move: ScanMove | None


def writes(stored: Stored, *, now: float, ended: tuple[int, JobState] | None = None,
           learned: dict[str, Any] | None = None) -> Writes:
    """A scan's next move once job `ended[0]` ended as `ended[1]` having learned `learned`, or, with nothing
    ended, whatever its jobs call for (the reconciler)."""
    scope = stored.scope()
    if ended is not None and ended[1] is JobState.SUCCESS:
        scope = merge_scope(scope, learned)
    row = stored.row
    p: Plan = plan(stored.states(), scope=scope, ended=ended, continue_on_failure=bool(row[7]),
                   cancel_requested=row[12] is not None)
    before = stored.states()
    changed = [(i, s) for i, (old, s) in enumerate(zip(before, p.states, strict=True))
               if s != old and i != p.start]
    start = None
    move = ScanMove(stored.id, row[1], *(ended or (None, None)))
    if p.start is not None:
        job = stored.jobs[p.start]
        task = step_task(StepSpec.of_json(json.loads(job[2])), payload=loads(row[4]), scope=p.scope,
                         priority=row[6], organization=row[3])
        start = (p.start, task, canonical_json(p.scope), job[5])
        move = ScanMove(move.scan_id, move.profile, move.index, move.job, type=task.type, started=p.start)
    if p.finish is not None:
        move = ScanMove(move.scan_id, move.profile, move.index, move.job, move.task_id, move.type, move.started,
                        p.finish)
    quiet = move == ScanMove(stored.id, row[1])
    return Writes(changed, start, p.finish or ScanState.RUNNING, canonical_json(p.scope),
                  now if p.finish is not None else None, None if quiet else move)
