"""The node's operations as its API asks for them: submits checked against this node's task types and
the fleet's resources, cancels that stop a running attempt, retries, pool sizes, schedules, readiness.

`NodeOperations` implements `api.operations.Operations`, answering with domain objects and the API's plain
views, which the API renders; the daemon builds one and hands it to the API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..api.operations import NodesView, PoolView, ScanRequest, ScheduleView
from ..errors import Conflict, InvalidRequest, ScanNotFound, StoreUnavailable, TaskNotFound
from ..events import EventBus
from ..execution.guards import Guards
from ..execution.leases import LeaseKeeper
from ..execution.pool import Pool
from ..execution.resources import ResourcePool
from ..execution.waker import Waker
from ..gateway.registry import WorkerRegistry
from ..metrics.exporter import Metrics
from ..model import (
    CANCELLED_ON_REQUEST,
    Artifact,
    Blob,
    NewTask,
    RemoteWorker,
    State,
    Task,
    WorkerChange,
    WorkerState,
    canonical_json,
    rfc3339,
)
from ..plugins import Registry
from ..plugins.scope import Resolved
from ..scans import SCOPE_MAX_BYTES, JobState, NewScan, Scan, ScanState, StepSpec
from ..schedules import Schedule, task_for, tick_key, validate
from ..settings import Settings
from ..settings.profiles import ProfileSettings
from ..store import Page, Store, retry_step
from ..store.port import CancelAnswer, ScanMove, ScanPage
from .submits import PayloadCheck, ScopeCheck

log = logging.getLogger("tidepool.service")  # the node's own lines, under the name they always had
READY_PROBE_S = 2.0  # /readyz: a store slower than this to count the queue is as good as away
QUEUE_STATES = ("pending", "leased", "running", "retry_wait", "cancelling")


@dataclass
class NodeStatus:
    """Where the node is in its life: what /readyz, /v1/pool and /metrics say of it."""

    ready: bool = False
    draining: bool = False
    pending_restart: list[str] = field(default_factory=list)  # keys a reload read but only a restart applies


@dataclass(frozen=True)
class NodeParts:
    """The running parts the operations act on."""

    store: Store
    events: EventBus
    waker: Waker
    pool: Pool
    leases: LeaseKeeper
    guards: Guards
    resources: ResourcePool
    metrics: Metrics
    workers: WorkerRegistry  # the remote workers a gateway serves (any node of the store may read and change them)


async def store_answers(store: Store) -> dict[State, int]:
    """The queue by state, as the probes ask it (/readyz, tidepool_store_up): a store whose writes fail
    does not answer, though it may still read (a full disk, a file made read-only, a corrupt one)."""
    failure = await store.write_failure()
    if failure is not None:
        raise StoreUnavailable(failure)
    return await store.counts()


class NodeOperations:
    def __init__(self, settings: Settings, registry: Registry, parts: NodeParts, *, node_id: str,
                 status: NodeStatus) -> None:
        self._parts = parts
        self._store = parts.store
        self.events = parts.events
        self._node_id = node_id
        self._status = status
        self.registry = registry
        self._settings = settings
        self._check_payload = PayloadCheck(settings)
        self._check_scope = ScopeCheck(settings)
        self._shared_store = settings.db_path() is None  # SQLite: this node is the whole fleet
        self.scans = ScanOperations(settings, registry, ScanParts(
            parts.store, parts.events, parts.waker, parts.leases, parts.resources, self.fleet_tag_sets))

    def configure(self, settings: Settings, registry: Registry) -> None:
        """A reload's settings and task types: every submit, retry and schedule from now on is checked by them."""
        self._settings, self.registry = settings, registry
        self._check_payload = PayloadCheck(settings)
        self._check_scope = ScopeCheck(settings)
        self.scans.configure(settings, registry)

    @property
    def max_body_kb(self) -> int:
        return self._settings.api.max_body_kb

    @property
    def serves_workers(self) -> bool:
        return bool(self._settings.gateway.listen)

    def max_attempts_for(self, task_type: str) -> int:
        """The attempt budget of a new task of `task_type` that names none: its type's, else retry's."""
        settings = self.registry.types.get(task_type)
        own = None if settings is None else settings.max_attempts
        return self._settings.retry.max_attempts if own is None else own

    def _max_queued(self) -> int:
        return self._settings.pool.max_queued

    def defines(self, schedule: Schedule) -> bool:
        """Whether this node defines the schedule's type (or profile): one it does not is another node's to fire."""
        if schedule.profile is not None:
            return self.scans.defines(schedule.profile)
        return schedule.type is not None and self.registry.knows_type(schedule.type)

    def scheduled_task(self, schedule: Schedule, tick: float) -> NewTask | NewScan:
        """A schedule's task for a tick, as a submit of its type makes one: the type's attempt budget and tags;
        a profile schedule's scan, as a submit of its profile makes one."""
        if schedule.profile is not None:
            return self.scans.scheduled(schedule, tick)
        assert schedule.type is not None
        return task_for(schedule, tick, max_attempts=self.max_attempts_for(schedule.type),
                        required_tags=self.registry.required_tags(schedule.type))

    # tasks

    def check(self, new: NewTask, *, fleet_tags: Sequence[frozenset[str]] = ()) -> NewTask:
        """Validate a submission; it comes back with its type's required_tags added, so claims see them.
        `fleet_tags` are the resource tag sets of the live nodes sharing the store."""
        if not self.registry.knows_type(new.type):
            raise InvalidRequest("type", f"unknown task type {new.type!r}")
        self._check_payload(new.type, new.payload)
        type_tags = self.registry.required_tags(new.type)
        if not type_tags <= set(new.required_tags):
            new = dataclasses.replace(new, required_tags=tuple(sorted(type_tags.union(new.required_tags))))
        if new.required_tags and not self._parts.resources.can_serve(new.required_tags) and \
                not any(set(new.required_tags) <= tags for tags in fleet_tags):
            raise InvalidRequest("required_tags", f"no resource of this fleet has tags {list(new.required_tags)}")
        return new

    async def fleet_tag_sets(self) -> list[frozenset[str]]:
        """This node's resource tag sets and, on a shared store, every live node's: what the fleet can serve."""
        own = list(self._parts.resources.tag_sets())
        if self.serves_workers or self._shared_store:  # remote workers' slots (a SQLite store has none but a gateway's)
            own += await self._parts.workers.tag_sets()
        if not self._shared_store:
            return own
        now = time.time()
        return own + [frozenset(tags) for node in await self._store.list_nodes() if node.alive(now)
                      for tags in node.tags]

    async def _fleet_tags(self, tasks: Sequence[NewTask]) -> list[frozenset[str]]:
        """The fleet's tag sets, when a submission asks for tags (its own or its type's)."""
        wants_tags = any(t.required_tags or self.registry.required_tags(t.type) for t in tasks)
        return await self.fleet_tag_sets() if wants_tags else []

    async def submit(self, new: NewTask) -> tuple[Task, bool]:
        new = self.check(new, fleet_tags=await self._fleet_tags([new]))
        await self._check_scope(new.type, new.payload)
        task, created = await self._store.add(new, now=time.time(), max_queued=self._max_queued())
        if created:
            self._created(task.id, new)
            self._parts.waker.wake(1)
        return task, created

    async def submit_many(self, news: list[NewTask]) -> list[tuple[str, bool]]:
        fleet = await self._fleet_tags(news)
        resolved: Resolved = {}  # a batch of tasks against one host resolves it once
        for i, new in enumerate(news):
            try:
                news[i] = self.check(new, fleet_tags=fleet)
                await self._check_scope(new.type, new.payload, resolved=resolved)
            except InvalidRequest as exc:
                raise type(exc)(f"tasks.{i}.{exc.field}", str(exc).split(": ", 1)[1]) from None
        added = await self._store.add_many(news, now=time.time(), max_queued=self._max_queued())
        fresh = [(task_id, new) for (task_id, created), new in zip(added, news, strict=True) if created]
        for task_id, new in fresh:
            self._created(task_id, new)
        if fresh:
            self._parts.waker.wake(len(fresh))
        return added

    def _created(self, task_id: str, new: NewTask) -> None:
        self.events.publish("task.created", task_id=task_id, worker_id=None, type=new.type, priority=new.priority)

    async def get(self, task_id: str) -> Task:
        return await self._store.get(task_id)

    async def list_tasks(self, *, state: State | None, type: str | None, limit: int, cursor: str | None,
                         organization: str | None = None) -> Page:
        return await self._store.list_tasks(state=state, type=type, limit=limit, cursor=cursor,
                                            organization=organization)

    async def cancel(self, task_id: str) -> State:
        answer = await self._store.request_cancel(task_id, now=time.time())
        if not answer.moved:  # a repeated cancel changes nothing, so there is nothing to say
            return answer.state
        announce_cancel(self.events, self._parts.leases, task_id, answer)
        log.info("task %s cancel requested -> %s", task_id, answer.state.value)
        return answer.state

    async def retry(self, task_id: str) -> Task:
        known = await self._store.get(task_id)  # an unknown id is 404 before anything else
        retry_step(known.state)  # a task that may not be retried is 409 whatever its type
        if not self.registry.knows_type(known.type):  # as a submit of it would be
            raise InvalidRequest("type", f"unknown task type {known.type!r}: this node no longer defines it, and "
                                 "retried, the task would wait for a node that does")
        task = await self._store.retry(task_id, now=time.time(), max_queued=self._max_queued())
        self.events.publish("task.created", task_id=task_id, worker_id=None, type=task.type, retry=True)
        self._parts.waker.wake(1)
        log.info("task %s retried by request -> %s", task_id, task.state.value)
        return task

    # blobs and artifacts

    @property
    def max_blob_bytes(self) -> int:
        return self._settings.artifacts.max_blob_bytes

    async def put_blob(self, chunks: AsyncIterable[bytes], *, expect: str | None = None) -> tuple[Blob, bool]:
        blobs = self._parts.metrics.blobs
        blob, created = await self._store.put_blob(blobs.count_in(chunks), now=time.time(),
                                                   max_bytes=self.max_blob_bytes, expect=expect)
        if created:
            blobs.stored.inc((), blob.size)
            log.info("blob %s stored: %d bytes", blob.sha256, blob.size)
        return blob, created

    async def get_blob(self, sha256: str) -> Blob:
        return await self._store.get_blob(sha256)

    def read_blob(self, sha256: str, *, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        return self._parts.metrics.blobs.count_out(self._store.read_blob(sha256, start=start, stop=stop))

    async def list_artifacts(self, task_id: str) -> list[Artifact]:
        return await self._store.list_artifacts(task_id)

    # the pool and the fleet

    def resize(self, **sizes: Any) -> None:
        if self._status.draining:  # its workers are retiring for good: new sizes would only look as if they applied
            raise Conflict(f"node {self._node_id} is draining (shutting down): its pool is not resized")
        pool = self._parts.pool
        if pool.resize(**sizes):
            log.info("pool resized: min %d max %d idle %.1fs", pool.config.min_workers, pool.config.max_workers,
                     pool.config.idle_timeout_s)

    async def pool_view(self) -> PoolView:
        stats = self._parts.pool.statistics()
        counts = await self._store.counts()
        return PoolView(stats, node_id=self._node_id, draining=self._status.draining,
                        queue={s: counts.get(State(s), 0) for s in QUEUE_STATES},
                        guards=self._parts.guards.statistics(),
                        resources=self._parts.resources.statistics().resources,
                        pending_restart=self._status.pending_restart)

    async def nodes_view(self) -> NodesView:
        """The registry's nodes and the remote workers served (a pending one is no part of the fleet yet)."""
        now = time.time()
        nodes = await self._store.list_nodes()
        heard_within_s = self._settings.gateway.max_wait_s + self._settings.lease.duration_s
        remote = [w for w in await self._parts.workers.list_workers() if w.state is not WorkerState.PENDING]
        return NodesView(nodes, remote, now=now, heard_within_s=heard_within_s)

    # remote workers

    async def list_workers(self) -> list[RemoteWorker]:
        return await self._parts.workers.list_workers()

    async def get_worker(self, worker_id: str) -> RemoteWorker:
        return await self._parts.workers.get(worker_id)

    async def change_worker(self, worker_id: str, change: WorkerChange) -> RemoteWorker:
        return await self._parts.workers.change(worker_id, change)

    async def revoke_worker(self, worker_id: str) -> RemoteWorker:
        return await self._parts.workers.revoke(worker_id)

    # schedules

    async def schedules_view(self) -> list[ScheduleView]:
        return [await self.schedule_view(schedule) for schedule in await self._store.list_schedules()]

    async def schedule_view(self, schedule: Schedule) -> ScheduleView:
        """The schedule with the state of its last task or scan (gone, if pruned: None)."""
        if schedule.profile is not None:
            scan_state = None
            if schedule.last_task_id is not None:
                with contextlib.suppress(ScanNotFound):
                    scan_state = (await self._store.get_scan(schedule.last_task_id)).state
            return ScheduleView(schedule, last_scan_state=scan_state)
        state = None
        if schedule.last_task_id is not None:
            with contextlib.suppress(TaskNotFound):
                state = (await self._store.get(schedule.last_task_id)).state
        return ScheduleView(schedule, last_task_state=state)

    async def save_schedule(self, schedule: Schedule) -> Schedule:
        await self.check_schedule(schedule)
        return await self._saved(schedule)

    async def check_schedule(self, schedule: Schedule) -> None:
        """InvalidRequest (OutOfScope among them) where a tick of `schedule` would be refused as a submit: its
        type or profile, its payload, the scopes of its plugins. The config file's schedules are checked so too."""
        validate(schedule)
        if schedule.profile is not None:  # checked as a submit of its profile would be
            await self.scans.resolve(ScanRequest(schedule.profile, dict(schedule.payload), schedule.priority))
            return
        assert schedule.type is not None
        probe = task_for(schedule, time.time(), max_attempts=self.max_attempts_for(schedule.type),
                         required_tags=self.registry.required_tags(schedule.type))  # checked as its submit would be
        try:
            self.check(probe, fleet_tags=await self._fleet_tags([probe]))
            await self._check_scope(probe.type, probe.payload)
        except InvalidRequest as exc:
            if exc.field != "required_tags":  # the type, or a payload its commands cannot take
                raise
            raise InvalidRequest("type", f"type {schedule.type!r} needs tags no resource of this fleet has: "
                                 f"{sorted(self.registry.required_tags(schedule.type))}") from None

    async def _saved(self, schedule: Schedule) -> Schedule:
        saved = await self._store.save_schedule(schedule, now=time.time())
        log.info("schedule %s saved, next run %s", saved.name, rfc3339(saved.next_run_at))
        return saved

    async def delete_schedule(self, name: str) -> None:
        await self._store.delete_schedule(name)

    async def pause_schedule(self, name: str, *, paused: bool) -> Schedule:
        saved = await self._store.pause_schedule(name, paused=paused, now=time.time())
        log.info("schedule %s %s", name, "paused" if paused else "resumed")
        return saved

    # probes

    async def not_ready_reason(self) -> str | None:
        if self._status.draining:
            return "draining"
        if not self._status.ready:
            return "starting"
        try:
            with anyio.fail_after(READY_PROBE_S):
                await store_answers(self._store)
        except StoreUnavailable as exc:
            return f"store unavailable: {exc}"
        except TimeoutError:
            return f"store unavailable: no answer within {READY_PROBE_S:g}s"
        return None

    async def render_metrics(self) -> bytes:
        return await self._parts.metrics.render()


# What a cancel that moved a task tells the node: the event of where it left the task, and the attempt
# stopped at once if one of this node's workers runs it.

def announce_cancel(events: EventBus, leases: LeaseKeeper, task_id: str, answer: CancelAnswer) -> None:
    """A cancelling task's attempt is stopped here if it runs here (its worker then ends it); a queued one
    the cancel ended is finished."""
    if answer.state is State.CANCELLING:
        events.publish("task.cancel_requested", task_id=task_id, worker_id=None, type=answer.type)
        held = leases.find(task_id)
        if held is not None:
            held.stop("cancel")
    elif answer.state is State.CANCELLED:
        events.publish("task.finished", task_id=task_id, worker_id=None, state=answer.state.value,
                       error=CANCELLED_ON_REQUEST.to_json(), type=answer.type)


# The node's scan operations as its API asks for them: submits checked against this node's profiles and task
# types, with each step's task defaults resolved; cancels that stop the running step; retries of a job; and the
# events of every scan move the store reports, wherever it was made (a worker's finish, the reconciler).
#
# `ScanOperations` implements `api.operations.ScanOps`; `NodeOperations.scans` is the node's one.

scan_log = logging.getLogger("tidepool.scans")  # the scans' own lines, apart from the node's
# A scan's payload travels in every step's task beside the scope: bounded as the scope is.
PAYLOAD_MAX_BYTES = SCOPE_MAX_BYTES


@dataclass(frozen=True)
class ScanParts:
    """The running parts the scan operations act on."""

    store: Store
    events: EventBus
    waker: Waker
    leases: LeaseKeeper
    resources: ResourcePool
    fleet_tags: Callable[[], Awaitable[list[frozenset[str]]]]  # the fleet's resource tag sets


class ScanOperations:
    def __init__(self, settings: Settings, registry: Registry, parts: ScanParts) -> None:
        self._parts = parts
        self._store = parts.store
        self.events = parts.events
        self.configure(settings, registry)

    def configure(self, settings: Settings, registry: Registry) -> None:
        """A reload's profiles and types: every submit from now on is resolved by them."""
        self._settings, self._registry = settings, registry
        self._profiles = settings.all_profiles
        self._check_payload = PayloadCheck(settings)
        self._check_scope = ScopeCheck(settings)

    @property
    def profiles(self) -> dict[str, ProfileSettings]:
        return self._profiles

    def defines(self, profile: str) -> bool:
        """Whether this node defines the profile: a schedule of one it does not is another node's to fire."""
        return profile in self._profiles

    # submit

    async def submit(self, request: ScanRequest) -> tuple[Scan, bool]:
        new = await self.resolve(request)
        scan, created = await self._store.add_scan(new, now=time.time(), max_queued=self._settings.pool.max_queued)
        if created:
            self.created(scan)
        return scan, created

    async def resolve(self, request: ScanRequest) -> NewScan:
        """The submit with its profile's steps and each step's task defaults (its type's attempt budget, timeout
        and tags), checked as a submit of each step's type would be; InvalidRequest naming the field."""
        new = self.new_scan(request)
        resolved: Resolved = {}
        for step in new.steps:  # what the payload names already; what the steps learn is checked as each starts
            await self._check_scope(step.type, new.payload, resolved=resolved)
        await self._check_tags(request.profile, new.steps)
        return new

    def new_scan(self, request: ScanRequest) -> NewScan:
        """The scan of a request, checked but for the fleet's resources (resolve checks those too)."""
        profile = self._profiles.get(request.profile)
        if profile is None:
            known = ", ".join(sorted(self._profiles)) or "none"
            raise InvalidRequest("profile", f"unknown profile {request.profile!r}; this node defines {known}")
        _check_size(request.payload)
        steps = tuple(self._step(step) for step in profile.steps)
        self._check_payload(steps[0].type, request.payload)  # later steps' payloads hold what the earlier learn
        return NewScan(request.profile, steps, dict(request.payload), request.priority, request.organization,
                       profile.continue_on_failure, request.idempotency_key, dict(request.inputs))

    def scheduled(self, schedule: Schedule, tick: float) -> NewScan:
        """A profile schedule's scan for a tick, as a submit of its profile makes one; one per tick."""
        assert schedule.profile is not None
        try:
            return self.new_scan(ScanRequest(schedule.profile, dict(schedule.payload), schedule.priority,
                                             idempotency_key=tick_key(schedule, tick)))
        except InvalidRequest as exc:  # the tick is skipped as "refused": say why, once per tick
            scan_log.error("schedule %s: the scan of its tick %s is refused: %s", schedule.name, rfc3339(tick), exc)
            raise

    async def announce(self, scan_id: str) -> None:
        """A scan another part created (a schedule's): told as a submitted one is. It is in the store already:
        a read that fails costs its events, not the scan (a worker is woken all the same)."""
        try:
            scan = await self._store.get_scan(scan_id)
        except (ScanNotFound, StoreUnavailable) as exc:
            scan_log.warning("scan %s created; its events are not told: %s", scan_id, exc)
            self._parts.waker.wake(1)
            return
        self.created(scan)

    def _step(self, step: str) -> StepSpec:
        own = self._registry.types.get(step)
        if own is None:  # the profile and the registry come from one config: a step is always a type
            raise InvalidRequest("profile", f"step {step!r} is not a task type of this node")
        max_attempts = self._settings.retry.max_attempts if own.max_attempts is None else own.max_attempts
        return StepSpec(step, max_attempts, own.timeout_s, tuple(sorted(self._registry.required_tags(step))))

    async def _check_tags(self, profile: str, steps: Sequence[StepSpec]) -> None:
        needing = [s for s in steps if s.required_tags and not self._parts.resources.can_serve(s.required_tags)]
        if not needing:
            return
        fleet = await self._parts.fleet_tags()
        for index, step in enumerate(steps):
            if step in needing and not any(set(step.required_tags) <= tags for tags in fleet):
                raise InvalidRequest("profile", f"step {index} ({step.type}) of profile {profile!r} needs tags no "
                                     f"resource of this fleet has: {list(step.required_tags)}")

    # reads

    async def get(self, scan_id: str) -> Scan:
        return await self._store.get_scan(scan_id)

    async def list(self, *, state: ScanState | None, profile: str | None, limit: int,
                   cursor: str | None) -> ScanPage:
        return await self._store.list_scans(state=state, profile=profile, limit=limit, cursor=cursor)

    # cancel and retry

    async def cancel(self, scan_id: str) -> ScanState:
        """Cancel the scan's live task as a task cancel does (a running one is stopped here if this node runs
        it); the store skips its waiting jobs, and ends it once that task has ended."""
        answer = await self._store.cancel_scan(scan_id, now=time.time())
        if not answer.moved:
            return answer.state
        if answer.task is not None and answer.task.moved and answer.task_id is not None:
            announce_cancel(self.events, self._parts.leases, answer.task_id, answer.task)
        scan_log.info("scan %s cancel requested -> %s", scan_id, answer.state.value)
        return answer.state

    async def retry(self, scan_id: str, index: int) -> Scan:
        scan = await self._store.retry_job(scan_id, index, now=time.time(), max_queued=self._settings.pool.max_queued)
        job = scan.jobs[index]
        scan_log.info("scan %s job %d (%s) retried by request: task %s", scan_id, index, job.step, job.task_id)
        self._step_started(scan.id, scan.profile, index, job.step, job.task_id, scan.priority)
        self._parts.waker.wake(1)
        return scan

    # events

    def created(self, scan: Scan) -> None:
        """A scan the store created (a submit's, a schedule's), with its first job's task."""
        first = scan.jobs[0]
        self.events.publish("scan.created", scan_id=scan.id, task_id=first.task_id, worker_id=None,
                            profile=scan.profile, organization=scan.organization, steps=len(scan.jobs))
        scan_log.info("scan %s created: profile %s, %d steps, job 0 (%s) task %s", scan.id, scan.profile,
                      len(scan.jobs), first.step, first.task_id)
        self._step_started(scan.id, scan.profile, 0, first.step, first.task_id, scan.priority)
        self._parts.waker.wake(1)

    def moved(self, moves: Sequence[ScanMove]) -> None:
        """The store's listener: the moves of scans it committed (a step's end, the next step's task, a scan's
        end), announced; a worker woken for each task they created."""
        created = 0
        for move in moves:
            if move.index is not None and move.job is not None:
                self.events.publish("scan.step", scan_id=move.scan_id, task_id=None, worker_id=None,
                                    profile=move.profile, index=move.index, state=move.job.value)
                # its task's own line says a success; a step that failed is the scan's news
                scan_log.log(logging.DEBUG if move.job is JobState.SUCCESS else logging.INFO,
                             "scan %s job %d ended %s", move.scan_id, move.index, move.job.value)
            if move.started is not None and move.task_id is not None:
                self._step_started(move.scan_id, move.profile, move.started, move.type, move.task_id, None)
                created += 1
            if move.finished is not None:
                self.events.publish("scan.finished", scan_id=move.scan_id, task_id=None, worker_id=None,
                                    profile=move.profile, state=move.finished.value)
                scan_log.info("scan %s finished %s", move.scan_id, move.finished.value)
        if created:
            self._parts.waker.wake(created)

    def _step_started(self, scan_id: str, profile: str, index: int, step: str | None, task_id: str | None,
                      priority: int | None) -> None:
        self.events.publish("task.created", task_id=task_id, worker_id=None, type=step, priority=priority,
                            scan_id=scan_id)
        self.events.publish("scan.step", scan_id=scan_id, task_id=task_id, worker_id=None, profile=profile,
                            index=index, state=JobState.QUEUED.value)


def _check_size(payload: dict[str, Any]) -> None:
    try:
        size = len(canonical_json(payload).encode())
    except (TypeError, ValueError) as exc:  # not from the API (it parsed JSON): a schedule's TOML date, say
        raise InvalidRequest("payload", f"must be JSON: {exc}") from None
    if size > PAYLOAD_MAX_BYTES:
        raise InvalidRequest("payload", f"{size} bytes of compact JSON; a scan's payload travels in each of its "
                             f"steps' tasks and is bounded at {PAYLOAD_MAX_BYTES} bytes")

