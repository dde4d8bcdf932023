"""The node's scan operations as its API asks for them: submits checked against this node's profiles and task
types, with each step's task defaults resolved; cancels that stop the running step; retries of a job; and the
events of every scan move the store reports, wherever it was made (a worker's finish, the reconciler).

`ScanOperations` implements `api.ops.ScanOps`; `NodeOperations.scans` is the node's one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .api.ops import ScanRequest
from .cancels import announce_cancel
from .errors import InvalidRequest, ScanNotFound, StoreUnavailable
from .events import EventBus
from .leases import LeaseKeeper
from .model import canonical_json, rfc3339
from .plugins import Registry
from .resources import ResourcePool
from .scans import SCOPE_MAX_BYTES, JobState, NewScan, Scan, ScanState, StepSpec
from .schedules import Schedule, tick_key
from .settings import Settings
from .settings.profiles import ProfileSettings
from .store import Store
from .store.port import ScanMove, ScanPage
from .templates import PayloadCheck
from .waker import Waker

log = logging.getLogger("tidepool.scans")
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
                       profile.continue_on_failure, request.idempotency_key)

    def scheduled(self, schedule: Schedule, tick: float) -> NewScan:
        """A profile schedule's scan for a tick, as a submit of its profile makes one; one per tick."""
        assert schedule.profile is not None
        try:
            return self.new_scan(ScanRequest(schedule.profile, dict(schedule.payload), schedule.priority,
                                             idempotency_key=tick_key(schedule, tick)))
        except InvalidRequest as exc:  # the tick is skipped as "refused": say why, once per tick
            log.error("schedule %s: the scan of its tick %s is refused: %s", schedule.name, rfc3339(tick), exc)
            raise

    async def announce(self, scan_id: str) -> None:
        """A scan another part created (a schedule's): told as a submitted one is. It is in the store already:
        a read that fails costs its events, not the scan (a worker is woken all the same)."""
        try:
            scan = await self._store.get_scan(scan_id)
        except (ScanNotFound, StoreUnavailable) as exc:
            log.warning("scan %s created; its events are not told: %s", scan_id, exc)
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
        log.info("scan %s cancel requested -> %s", scan_id, answer.state.value)
        return answer.state

    async def retry(self, scan_id: str, index: int) -> Scan:
        scan = await self._store.retry_job(scan_id, index, now=time.time(), max_queued=self._settings.pool.max_queued)
        job = scan.jobs[index]
        log.info("scan %s job %d (%s) retried by request: task %s", scan_id, index, job.step, job.task_id)
        self._step_started(scan.id, scan.profile, index, job.step, job.task_id, scan.priority)
        self._parts.waker.wake(1)
        return scan

    # events

    def created(self, scan: Scan) -> None:
        """A scan the store created (a submit's, a schedule's), with its first job's task."""
        first = scan.jobs[0]
        self.events.publish("scan.created", scan_id=scan.id, task_id=first.task_id, worker_id=None,
                            profile=scan.profile, organization=scan.organization, steps=len(scan.jobs))
        log.info("scan %s created: profile %s, %d steps, job 0 (%s) task %s", scan.id, scan.profile, len(scan.jobs),
                 first.step, first.task_id)
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
                log.log(logging.DEBUG if move.job is JobState.SUCCESS else logging.INFO, "scan %s job %d ended %s",
                        move.scan_id, move.index, move.job.value)
            if move.started is not None and move.task_id is not None:
                self._step_started(move.scan_id, move.profile, move.started, move.type, move.task_id, None)
                created += 1
            if move.finished is not None:
                self.events.publish("scan.finished", scan_id=move.scan_id, task_id=None, worker_id=None,
                                    profile=move.profile, state=move.finished.value)
                log.info("scan %s finished %s", move.scan_id, move.finished.value)
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

