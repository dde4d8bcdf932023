"""The scheduler loop: fires due schedule ticks through the store, which makes each tick fire once."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

import anyio
from anyio.abc import TaskStatus

from ..errors import InvalidRequest, ScheduleNotFound, StoreUnavailable
from ..events import EventBus
from ..logs import Outage
from ..model import NewTask, rfc3339
from ..scans import NewScan
from ..schedules import Fired, Schedule, validate
from ..settings import PoolSettings, ScheduleSettings
from ..store import Store

log = logging.getLogger("tidepool.scheduler")

ScheduleCheck = Callable[[Schedule], Awaitable[None]]  # InvalidRequest where a tick would be refused as a submit


class Scheduler:
    def __init__(self, store: Store, events: EventBus, *, node_id: str,
                 new_task: Callable[[Schedule, float], NewTask | NewScan], wake: Callable[[int], None],
                 interval_s: float = 0.5, defines: Callable[[Schedule], bool] = lambda schedule: True,
                 max_queued: int | None = None, clock: Callable[[], float] = time.time,
                 scan_started: Callable[[str], Awaitable[None]] | None = None) -> None:
        self._store = store
        self._node_id = node_id
        self._events = events
        self._new_task = new_task  # a tick's task (or scan), as a submit of its type (or profile) would be
        self._defines = defines  # the schedules of types this node does not define are another node's to fire
        self._scan_started = scan_started  # a profile schedule's scan is announced as a submitted one is
        self._max_queued = max_queued
        self._wake = wake
        self.interval_s = interval_s
        self._clock = clock
        self._outage = Outage(log)  # the store did not answer: said once, not every tick

    def configure(self, section: PoolSettings) -> None:
        """A reload's pool settings: a tick past pool.max_queued is skipped."""
        self._max_queued = section.max_queued

    async def save_config(self, configured: Sequence[ScheduleSettings], *, source: str,
                          timeout_s: float = math.inf, check: ScheduleCheck | None = None) -> None:
        """Save the config's [[schedules]] (a failure is logged: the next start or SIGHUP tries again). Then
        say which stored schedules name a type this node does not define: it leaves them to a node that
        does, and with no such node (SQLite has one) they do not fire at all."""
        stored = None
        with anyio.move_on_after(timeout_s):
            try:
                stored = await self.sync_config(configured, check=check)
            except (InvalidRequest, StoreUnavailable) as exc:
                log.error("schedules from %s not saved: %s", source, exc)
                return
        if stored is None:
            log.warning("reload: the config's schedules were not saved within %gs (the store does not answer); "
                        "the next SIGHUP or start saves them", timeout_s)
            return
        for schedule in stored:
            if not self._defines(schedule):
                what = f"task type {schedule.type!r}" if schedule.type is not None else f"profile {schedule.profile!r}"
                log.warning("schedule %s names %s, which this node does not define: it fires only on a node that "
                            "does", schedule.name, what)

    async def sync_config(self, configured: Sequence[ScheduleSettings], *,
                          check: ScheduleCheck | None = None) -> list[Schedule]:
        """Save the config file's schedules, their state (next/last run, paused) kept, and remove those
        this node's config defined before and defines no more; the schedules stored then. A schedule saved
        through the API, or by another node's config, is not this file's to remove: on a fleet, one node
        may define them all."""
        schedules = [validate(from_settings(item, self._node_id)) for item in configured]
        if check is not None:  # all of them before any is saved: a refused one leaves the stored ones as they were
            for schedule in filter(self._defines, schedules):  # another node's type is that node's to check
                try:
                    await check(schedule)
                except InvalidRequest as exc:
                    raise InvalidRequest(f"schedules.{schedule.name}.{exc.field}",
                                         str(exc).removeprefix(f"{exc.field}: ")) from None
        for schedule in schedules:
            await self._store.save_schedule(schedule, now=self._clock())
        names = {item.name for item in configured}
        kept = []
        for schedule in await self._store.list_schedules():
            if schedule.config_node == self._node_id and schedule.name not in names:
                try:  # fenced: not if an API save or another node's config has taken it over since the list
                    await self._store.delete_schedule(schedule.name, config_node=self._node_id)
                except ScheduleNotFound:
                    kept.append(schedule)
                    continue
                log.info("schedule %s removed: the config file no longer defines it", schedule.name)
            else:
                kept.append(schedule)
        return kept

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                await self.tick()
                self._outage.over("scheduler: the store answers again")
            except StoreUnavailable as exc:
                self._outage.failing("scheduler passes skipped until the store answers: %s", exc)
            await anyio.sleep(self.interval_s)

    async def tick(self) -> list[Fired]:
        fired = await self._store.fire_schedules(now=self._clock(), new_task=self._new_task,
                                                 defines=self._defines, max_queued=self._max_queued)
        created = 0
        for f in fired:
            if f.scan_id is not None:
                self._events.publish("schedule.fired", task_id=None, worker_id=None, schedule=f.schedule,
                                     tick=rfc3339(f.tick), scan_id=f.scan_id)
                log.info("schedule %s fired for %s: scan %s", f.schedule, rfc3339(f.tick), f.scan_id)
                if self._scan_started is not None:
                    await self._scan_started(f.scan_id)
            elif f.task_id is not None:
                created += 1
                self._events.publish("task.created", task_id=f.task_id, worker_id=None, type=f.type,
                                     priority=f.priority, schedule=f.schedule)
                self._events.publish("schedule.fired", task_id=f.task_id, worker_id=None, schedule=f.schedule,
                                     tick=rfc3339(f.tick))
                log.info("schedule %s fired for %s: task %s", f.schedule, rfc3339(f.tick), f.task_id)
            else:
                self._events.publish("schedule.skipped", task_id=None, worker_id=None, schedule=f.schedule,
                                     tick=rfc3339(f.tick), reason=f.reason, count=f.count)
                log.info("schedule %s skipped %d tick(s) up to %s: %s", f.schedule, f.count, rfc3339(f.tick),
                         f.reason)
        if created:
            self._wake(created)
        return fired


def from_settings(item: ScheduleSettings, node_id: str) -> Schedule:
    return Schedule(name=item.name, type=item.type, payload=dict(item.payload), cron=item.cron, every_s=item.every_s,
                    timezone=item.timezone, jitter_s=item.jitter_s, catch_up=item.catch_up, overlap=item.overlap,
                    priority=item.priority, profile=item.profile, config_node=node_id)
