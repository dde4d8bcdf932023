"""The composition root: builds a node from settings, runs it, drains it on SIGTERM, reloads on SIGHUP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import gc
import glob
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from . import __version__, logs
from . import settings as settings_mod
from .api import serve_api
from .api.app import load_token
from .engine import Engine, EngineConfig
from .errors import ConfigError, Conflict, InvalidRequest, StoreUnavailable, TaskNotFound
from .events import EventBus, first_id_of_this_run
from .fleet import GoneNodes, fence_after_s
from .guards import Guards
from .leases import LeaseKeeper
from .lifecycle import retry_policy
from .metrics import Metrics
from .model import CANCELLED_ON_REQUEST, QUEUED, AttemptStatus, ClaimFilter, NewTask, State, Task, new_id, rfc3339
from .nodes import Heartbeat
from .outcomes import UnwrittenInterruptions
from .plugins import Registry
from .pool import Pool, PoolConfig
from .reconciler import Reconciler, ReconcilerConfig
from .resources import ResourcePool
from .scheduler import Scheduler
from .schedules import Schedule, task_for, validate
from .settings import BUILTIN_TYPES, Settings
from .store import Node, Store, open_store, retry_step
from .systemd import Notifier, StatusReporter, run_watchdog
from .templates import check_payload

log = logging.getLogger("tidepool.service")
OUTCOME_FLUSH_S = 10.0  # at shutdown, after the drain and the stop phases, for outcomes a slow store still holds
READY_PROBE_S = 2.0  # /readyz: a store slower than this to count the queue is as good as away
RELOAD_SYNC_S = 5.0  # a SIGHUP saves the config's schedules within this, or leaves them to the next one
RESTART_KEYS = ("store.url", "api.listen", "node.id", "node.state_dir", "node.heartbeat_s", "api.token_file",
                "api.max_body_kb")
GC_YOUNG_THRESHOLD = 20_000
QUEUE_STATES = ("pending", "leased", "running", "retry_wait", "cancelling")


class Daemon:
    """One node: store, pool, engine, leases, reconciler and API, wired from one Settings."""

    def __init__(self, settings: Settings, *, config_path: Path | None = None,
                 notifier: Notifier | None = None, when_drained: Callable[[], None] = lambda: None) -> None:
        self.settings = settings
        self._when_drained = when_drained  # every outcome written: see cli's bounded exit
        self._reload_when_ready = False  # a SIGHUP came while the node was starting
        self.config_path = config_path
        self.notifier = notifier or Notifier()
        self.node_id = settings.node.node_id
        self.instance_id = new_id()
        self.ready = False
        self.draining = False
        self.pending_restart: list[str] = []
        self._boot_settings = settings  # what the running store, API and node were built from
        self.store: Store = open_store(settings.store.url)
        self.events = EventBus(first_id=first_id_of_this_run())
        self.metrics = Metrics(node_id=self.node_id, version=__version__, pool=lambda: self.pool.statistics(),
                               counts=self._store_answers, guards=lambda: self.guards.statistics(),
                               draining=lambda: self.draining)
        self.events.listen(self.metrics.on_event)
        self.events.listen(logs.lifecycle)
        self.registry = _registry(settings)
        self.leases = LeaseKeeper(self.metrics.lease_store(self.store), lease_s=settings.lease.duration_s,
                                  renew_every_s=settings.lease.renew_every_s,
                                  fence_after_s=fence_after_s(settings.node.heartbeat_s))
        # A freed slot or cleared guard means claimable work may be waiting: wake a worker now.
        self.resources = ResourcePool.from_settings(settings.resources, on_free=lambda: self.pool.wake(1))
        self.guards = Guards(self.events, state_dir=settings.node.state_dir,
                             min_free_memory_mb=settings.guards.min_free_memory_mb,
                             min_free_disk_mb=settings.guards.min_free_disk_mb,
                             on_clear=lambda: self.pool.wake(self.pool.config.max_workers))
        # Absolute: a command runs in its work directory, where a relative {workdir} (state_dir = "./var",
        # the example's) would not resolve.
        self.work_root = settings.node.state_dir.absolute() / "work" / _file_safe(self.node_id)
        self.engine = Engine(self.store, self.registry, self.leases, self.events, config=_engine_config(settings),
                             policy=retry_policy(settings.retry), work_root=self.work_root, resources=self.resources)
        self.pool = Pool(self.store, self.engine, self.leases, self.events, config=_pool_config(settings),
                         node_id=self.node_id, instance_id=self.instance_id, claim_filter=self._claim_filter,
                         promise_slots=self.resources.claiming, may_claim=self._may_claim)
        self.reconciler = Reconciler(self.store, self.events, config=_reconciler_config(settings),
                                     policy=lambda: self.engine.policy, wake=self.pool.wake,
                                     fleet_tags=self._fleet_tag_sets)
        self.scheduler = Scheduler(self.store, self.events, node_id=self.node_id,
                                   new_task=self._scheduled_task, wake=self.pool.wake,
                                   defines=lambda type_name: self.registry.knows_type(type_name),
                                   max_queued=lambda: self.settings.pool.max_queued)
        self.started_at = time.time()
        self.heartbeat = Heartbeat(self.store, self._describe, interval_s=settings.node.heartbeat_s,
                                   on_saved=self.leases.heard)
        self.gone_nodes = GoneNodes(self.store, node_id=self.node_id, policy=lambda: self.engine.policy,
                                    report=self.reconciler._report_expired, fleet_seen=self.leases.fleet_seen)
        self._shutdown = anyio.Event()
        self._forced = False
        # Several nodes may share a state dir (one SQLite file, several node ids): each keeps its own.
        self._unwritten = UnwrittenInterruptions(
            settings.node.state_dir / f"unwritten-interruptions.{_file_safe(self.node_id)}.json")
        self._drain_wait: anyio.CancelScope | None = None  # a second SIGINT cuts the current wait short
        self._filter: tuple[Settings, int, ClaimFilter] | None = None

    @property
    def max_body_kb(self) -> int:
        return self.settings.api.max_body_kb

    def _scheduled_task(self, schedule: Schedule, tick: float) -> NewTask:
        """A schedule's task for a tick, as a submit of its type makes one: the type's attempt budget and tags."""
        return task_for(schedule, tick, max_attempts=self.max_attempts_for(schedule.type),
                        required_tags=self.registry.required_tags(schedule.type))

    def max_attempts_for(self, task_type: str) -> int:
        """The attempt budget of a new task of `task_type` that names none: its type's, else retry's."""
        settings = self.registry.types.get(task_type)
        own = None if settings is None else settings.max_attempts
        return self.settings.retry.max_attempts if own is None else own

    # running

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Open the store, start every part, then READY=1; on shutdown drain, stop and close the store.

        The API is bound before the pool starts, so a node that cannot bind its address exits having
        claimed nothing; READY=1 goes out once the pool's baseline workers run as well.
        """
        token = load_token(self.settings.api.token_file, self.settings.api.listen)
        check_state_dir(self.settings.node.state_dir)
        with self._node_lock():
            await self.store.open(migrate=self.settings.store.migrate)
            try:
                await self.store.lock_node(self.node_id, self.instance_id)  # PostgreSQL: one process per node id
                await self.reconciler.recover(node_id=self.node_id, instance_id=self.instance_id,
                                              interrupted=self._unwritten.read())
                self._unwritten.forget()  # written now (or their leases were gone already)
                self._say_left_out(self.settings)
                await self._sync_schedules(self.settings)
                await self.engine.remove_leftover_workdirs()
                async with anyio.create_task_group() as tg:
                    await tg.start(self._handle_signals)  # first: from here on a SIGTERM drains, never kills
                    await tg.start(self.leases.run)
                    await tg.start(partial(self.store.watch, self.pool.wake))  # other nodes' submits wake us
                    await tg.start(self.heartbeat.run)
                    await tg.start(self.guards.run)  # measured before the first claim
                    await tg.start(partial(serve_api, self, self.settings.api.listen, token=token))
                    _quiet_gc()
                    await tg.start(self.pool.run)
                    await tg.start(self.reconciler.run)
                    await tg.start(self.gone_nodes.run)
                    await tg.start(self.scheduler.run)
                    tg.start_soon(self._report_status)
                    tg.start_soon(self._watchdog)
                    self.ready = True  # /readyz answers 200 from here: before systemd hears READY=1
                    self.notifier.ready()
                    log.info("node %s ready: tidepool %s on %s, store %s, api %s, workers %d..%d; %s", self.node_id,
                             __version__, _loop_name(), redacted(self.settings.store.url), self.settings.api.listen,
                             self.pool.config.min_workers, self.pool.config.max_workers,
                             self.settings.ready_summary())
                    task_status.started()
                    if self._reload_when_ready:
                        tg.start_soon(self.reload)
                    await self._shutdown.wait()
                    await self._drain()
                    await self.heartbeat.leave()
                    tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    await self.store.close()
        log.info("node %s stopped", self.node_id)

    def shutdown(self) -> None:
        self._shutdown.set()

    async def _drain(self) -> None:
        """Stop claiming (batch-claimed tasks not started yet go back at once), let running tasks finish
        within drain_timeout_s, then interrupt the rest through their cancel scopes: their stop phases
        run and each attempt is recorded `interrupted`, its task back to pending (SPEC rule 6)."""
        self.draining = True
        self.notifier.stopping()
        self.pool.stop_claiming()
        drain_s = 0.0 if self._forced else self.settings.pool.drain_timeout_s
        log.info("node %s draining: %d tasks running, waiting up to %.1fs", self.node_id,
                 self.pool.statistics().busy, drain_s)
        with anyio.move_on_after(drain_s) as self._drain_wait:
            await self.pool.wait_idle()
        # An interrupted task kills its command's tree (kill_grace_s, then SIGKILL) and runs its stop phase.
        execution = self.settings.execution
        stop_s = 1.0 if self._forced else execution.kill_grace_s + execution.stop_timeout_s + 1.0
        running = self.pool.statistics().busy
        if running:
            log.info("node %s drain deadline passed: interrupting %d tasks", self.node_id, running)
            for h in self.leases.held():
                h.stop("interrupt")
            with anyio.move_on_after(stop_s) as self._drain_wait:
                await self.pool.wait_idle()
            self.engine.abandon_running()
        # Outcomes still unwritten (a slow store) get a little time of their own: all of this must end
        # within systemd's TimeoutStopSec (see shutdown_s).
        with anyio.move_on_after(min(stop_s, OUTCOME_FLUSH_S)):
            await self.engine.outcomes.flushed()
        if unwritten := self.engine.outcomes.unwritten():
            self._unwritten.keep(p.held.lease.attempt_id for p in unwritten
                                 if p.outcome.status is AttemptStatus.INTERRUPTED)
            log.warning("node %s: %d outcomes not written; their leases expire by time (interruptions are "
                        "written by the next start)", self.node_id, len(unwritten))
        self._when_drained()
        self.events.close()

    async def _handle_signals(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP and not self.ready:  # READY=1 must wait for the node, not the reload
                    log.info("SIGHUP while starting: the config is read again once the node is ready")
                    self._reload_when_ready = True
                elif signum == signal.SIGHUP:
                    await self.reload()
                elif self._shutdown.is_set() and signum == signal.SIGINT:
                    log.warning("second SIGINT: interrupting running tasks now")
                    self._forced = True
                    for h in self.leases.held():
                        h.stop("interrupt")
                    if self._drain_wait is not None:
                        self._drain_wait.cancel()
                elif self._shutdown.is_set():
                    log.info("received %s: already shutting down", signal.Signals(signum).name)
                else:
                    log.info("received %s: shutting down", signal.Signals(signum).name)
                    self._shutdown.set()

    async def _report_status(self) -> None:
        """STATUS= on change, at most once a second (SPEC §9)."""
        if not self.notifier.enabled:
            return  # nobody listens: an idle node should not query its store every second
        reporter = StatusReporter(self.notifier)
        while True:
            stats = self.pool.statistics()
            try:
                counts = await self.store.counts()
                queued = sum(counts.get(s, 0) for s in QUEUED)
            except StoreUnavailable:
                queued = -1
            text = f"workers {stats.workers}/{stats.max_workers} busy {stats.busy} queued {queued}"
            reporter.report(("draining: " if self.draining else "") + text, now=time.monotonic())
            # A little over the reporter's 1 s limit: uvloop's timers run on a millisecond clock and may
            # wake a hair early, and a text held back then would wait for the next round or be lost.
            await anyio.sleep(1.05)

    async def _watchdog(self) -> None:
        allowed_lag = max(5.0, self.pool.config.poll_interval_s * 3)
        await run_watchdog(self.notifier, is_alive=lambda: time.monotonic() - self.pool.last_tick < allowed_lag)

    @contextlib.contextmanager
    def _node_lock(self) -> Iterator[None]:
        """One daemon per node id and SQLite file (a lock file beside the database), and per node id and
        state dir (a lock file beside the work root): a start clears its work root, killing the commands an
        earlier daemon left running there, which must never be a running daemon's, whatever its store."""
        with contextlib.ExitStack() as locks:
            db = self.settings.db_path()
            if db is not None:
                db.parent.mkdir(parents=True, exist_ok=True)
                db = db.resolve()  # one file reached through a symlink is still one database: one lock
                locks.enter_context(_locked(db.with_name(f"{db.name}.{_file_safe(self.node_id)}.lock"),
                                            f"node {self.node_id} already runs on {db}"))
            self.work_root.parent.mkdir(parents=True, exist_ok=True)
            locks.enter_context(_locked(self.work_root.with_name(f"{self.work_root.name}.lock"),
                                        f"node {self.node_id} already runs with work directories in {self.work_root}"))
            yield

    # what the API asks for

    def check(self, new: NewTask, *, fleet_tags: Sequence[frozenset[str]] = ()) -> NewTask:
        """Validate a submission; it comes back with its type's required_tags added, so claims see them.
        `fleet_tags` are the resource tag sets of the live nodes sharing the store."""
        if not self.registry.knows_type(new.type):
            raise InvalidRequest("type", f"unknown task type {new.type!r}")
        check_payload(self.settings, new.type, new.payload)
        type_tags = self.registry.required_tags(new.type)
        if not type_tags <= set(new.required_tags):
            new = dataclasses.replace(new, required_tags=tuple(sorted(type_tags.union(new.required_tags))))
        if new.required_tags and not self.resources.can_serve(new.required_tags) and \
                not any(set(new.required_tags) <= tags for tags in fleet_tags):
            raise InvalidRequest("required_tags", f"no resource of this fleet has tags {list(new.required_tags)}")
        return new

    async def _fleet_tags(self, tasks: Sequence[NewTask]) -> list[frozenset[str]]:
        """The tag sets of every live node's resources, when a submission asks for tags (its own or its type's)."""
        wants_tags = any(t.required_tags or self.registry.required_tags(t.type) for t in tasks)
        return await self._fleet_tag_sets() if wants_tags else []

    async def _fleet_tag_sets(self) -> list[frozenset[str]]:
        """This node's resource tag sets and, on a shared store, every live node's: what the fleet can serve."""
        own = list(self.resources.tag_sets())
        if self.settings.db_path() is not None:
            return own  # SQLite: this node is the whole fleet
        now = time.time()
        return own + [frozenset(tags) for node in await self.store.list_nodes() if node.alive(now)
                      for tags in node.tags]

    async def submit(self, new: NewTask) -> tuple[Task, bool]:
        new = self.check(new, fleet_tags=await self._fleet_tags([new]))
        task, created = await self.store.add(new, now=time.time(), max_queued=self.settings.pool.max_queued)
        if created:
            self.events.publish("task.created", task_id=task.id, worker_id=None, type=task.type,
                                priority=task.priority)
            self.pool.wake(1)
        return task, created

    async def submit_many(self, news: list[NewTask]) -> list[tuple[str, bool]]:
        fleet = await self._fleet_tags(news)
        for i, new in enumerate(news):
            try:
                news[i] = self.check(new, fleet_tags=fleet)
            except InvalidRequest as exc:
                raise InvalidRequest(f"tasks.{i}.{exc.field}", str(exc).split(": ", 1)[1]) from None
        added = await self.store.add_many(news, now=time.time(), max_queued=self.settings.pool.max_queued)
        fresh = [(task_id, new) for (task_id, created), new in zip(added, news, strict=True) if created]
        for task_id, new in fresh:
            self.events.publish("task.created", task_id=task_id, worker_id=None, type=new.type,
                                priority=new.priority)
        if fresh:
            self.pool.wake(len(fresh))
        return added

    async def cancel(self, task_id: str) -> State:
        answer = await self.store.request_cancel(task_id, now=time.time())
        if not answer.moved:  # a repeated cancel: nothing happened, so nothing to say (rule 8)
            return answer.state
        if answer.state is State.CANCELLING:
            self.events.publish("task.cancel_requested", task_id=task_id, worker_id=None, type=answer.type)
            held = self.leases.find(task_id)
            if held is not None:
                held.stop("cancel")
        elif answer.state is State.CANCELLED:
            self.events.publish("task.finished", task_id=task_id, worker_id=None, state=answer.state.value,
                                error=CANCELLED_ON_REQUEST.to_json(), type=answer.type)
        log.info("task %s cancel requested -> %s", task_id, answer.state.value)
        return answer.state

    async def retry(self, task_id: str) -> Task:
        known = await self.store.get(task_id)  # an unknown id is 404 before anything else
        retry_step(known.state)  # a task that may not be retried is 409 whatever its type
        if not self.registry.knows_type(known.type):  # as a submit of it would be
            raise InvalidRequest("type", f"unknown task type {known.type!r}: this node no longer defines it, and "
                                 "retried, the task would wait for a node that does")
        task = await self.store.retry(task_id, now=time.time(), max_queued=self.settings.pool.max_queued)
        self.events.publish("task.created", task_id=task_id, worker_id=None, type=task.type, retry=True)
        self.pool.wake(1)
        log.info("task %s retried by request -> %s", task_id, task.state.value)
        return task

    def resize(self, **sizes: Any) -> None:
        if self.draining:  # its workers are retiring for good: new sizes would only look as if they applied
            raise Conflict(f"node {self.node_id} is draining (shutting down): its pool is not resized")
        if self.pool.resize(**sizes):
            log.info("pool resized: min %d max %d idle %.1fs", self.pool.config.min_workers,
                     self.pool.config.max_workers, self.pool.config.idle_timeout_s)

    async def pool_view(self) -> dict[str, Any]:
        stats = self.pool.statistics()
        counts = await self.store.counts()
        return {
            "node_id": self.node_id, "min_workers": stats.min_workers, "max_workers": stats.max_workers,
            "idle_timeout_s": stats.idle_timeout_s, "workers": stats.workers, "busy": stats.busy,
            "baseline": stats.baseline, "demand": stats.demand, "claiming": stats.claiming,
            "draining": self.draining, "queue": {s: counts.get(State(s), 0) for s in QUEUE_STATES},
            "guards": self.guards.statistics().to_json(),
            "resources": self.resources.statistics().to_json(),
            "pending_restart": self.pending_restart,
        }

    async def nodes_view(self) -> list[dict[str, Any]]:
        now = time.time()
        return [node.to_json(now=now) for node in await self.store.list_nodes()]

    def _describe(self, now: float) -> Node:
        """This node as the registry records it, with the figures that change live."""
        s = self.settings
        tags = tuple(tuple(sorted(r.tags)) for r in self._boot_settings.resources.values())
        return Node(self.node_id, self.instance_id, socket.gethostname(), os.getpid(), __version__, self.started_at,
                    now, self.heartbeat.interval_s, tuple(s.claimed_types()), tags, self.pool.config.max_workers)

    async def schedules_view(self) -> list[dict[str, Any]]:
        return [await self.schedule_view(schedule) for schedule in await self.store.list_schedules()]

    async def schedule_view(self, schedule: Schedule) -> dict[str, Any]:
        """The schedule's JSON with the state of its last task (gone, if pruned: null)."""
        state = None
        if schedule.last_task_id is not None:
            with contextlib.suppress(TaskNotFound):
                state = (await self.store.get(schedule.last_task_id)).state.value
        return schedule.to_json(last_task_state=state)

    async def save_schedule(self, schedule: Schedule) -> Schedule:
        validate(schedule)
        probe = self._scheduled_task(schedule, time.time())  # checked as its submit would be: type and tags
        try:
            self.check(probe, fleet_tags=await self._fleet_tags([probe]))
        except InvalidRequest as exc:
            if exc.field != "required_tags":  # the type, or a payload its commands cannot take
                raise
            raise InvalidRequest("type", f"type {schedule.type!r} needs tags no resource of this fleet has: "
                                 f"{sorted(self.registry.required_tags(schedule.type))}") from None
        saved = await self.store.save_schedule(schedule, now=time.time())
        log.info("schedule %s saved, next run %s", saved.name, rfc3339(saved.next_run_at))
        return saved

    async def pause_schedule(self, name: str, *, paused: bool) -> Schedule:
        saved = await self.store.pause_schedule(name, paused=paused, now=time.time())
        log.info("schedule %s %s", name, "paused" if paused else "resumed")
        return saved

    async def _store_answers(self) -> dict[State, int]:
        """The queue by state, as the probes ask it (/readyz, tidepool_store_up): a store whose writes fail
        does not answer, though it may still read (a full disk, a file made read-only, a corrupt one)."""
        failure = await self.store.write_failure()
        if failure is not None:
            raise StoreUnavailable(failure)
        return await self.store.counts()

    async def not_ready_reason(self) -> str | None:
        if self.draining:
            return "draining"
        if not self.ready:
            return "starting"
        try:
            with anyio.fail_after(READY_PROBE_S):
                await self._store_answers()
        except StoreUnavailable as exc:
            return f"store unavailable: {exc}"
        except TimeoutError:
            return f"store unavailable: no answer within {READY_PROBE_S:g}s"
        return None

    # reload

    async def reload(self) -> None:
        """SIGHUP: apply what can change live; keep the old config when the new file is invalid.

        RELOADING=1 goes out before the file is read and READY=1 after, whatever happened: without
        it `systemctl reload` hangs until its timeout (PITFALLS).
        """
        if self.draining:
            log.warning("reload ignored: node %s is shutting down", self.node_id)
            return
        self.notifier.reloading()
        try:
            await self._reload()
        finally:
            self.notifier.ready()

    async def _reload(self) -> None:
        where = self.config_path or "defaults"
        try:
            new = settings_mod.load(self.config_path)
            registry = _registry(new)
        except Exception as exc:  # a plugin module may raise anything on import: the node must live on
            self.metrics.reloaded(ok=False)
            reason = " ".join(str(exc).split("\n")) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
            log.error("reload of %s rejected, keeping the running config: %s", where, reason,
                      exc_info=not isinstance(exc, ConfigError))
            return
        changed = _changed_keys(self.settings, new)
        # Against what the node was started with: a key changed and changed back needs no restart.
        boot = self._boot_settings
        self.pending_restart = [k for k in RESTART_KEYS if _get(new, k) != _get(boot, k)]
        if new.resources != boot.resources:  # slots may be in use: the pool is built once
            self.pending_restart.append("resources")
        logs.setup(new.log.level, new.log.format)
        self.engine.registry = self.registry = registry  # submits check types against the new one too
        self.engine.config = _engine_config(new)
        self.engine.policy = retry_policy(new.retry)
        self.leases.configure(lease_s=new.lease.duration_s, renew_every_s=new.lease.renew_every_s)
        self.reconciler.config = _reconciler_config(new)
        self.guards.configure(min_free_memory_mb=new.guards.min_free_memory_mb,
                              min_free_disk_mb=new.guards.min_free_disk_mb)
        self.pool.config.poll_interval_s = new.pool.poll_interval_s
        self.pool.config.claim_batch = new.pool.claim_batch
        sizes = ("pool.min_workers", "pool.max_workers", "pool.idle_timeout_s")
        if self.pool.resize(min_workers=new.pool.min_workers, max_workers=new.pool.max_workers,
                            idle_timeout_s=new.pool.idle_timeout_s) and not any(k in changed for k in sizes):
            changed.append("pool sizes (back to the file's from PATCH /v1/pool)")
        self.settings = new
        self._say_left_out(new)
        # Even when the file did not change: an API save or delete since may have taken a schedule from it,
        # and a SIGHUP is how an operator puts the file's back (README). Bounded: the signal handler waits
        # for this, and a SIGTERM must not wait behind a store that does not answer.
        with anyio.move_on_after(RELOAD_SYNC_S) as syncing:
            await self._sync_schedules(new)
        if syncing.cancelled_caught:
            log.warning("reload: the config's schedules were not saved within %gs (the store does not answer); "
                        "the next SIGHUP or start saves them", RELOAD_SYNC_S)
        self.metrics.reloaded(ok=True)
        log.info("reloaded %s: %s", where, ", ".join(changed) if changed else "nothing changed")
        if self.pending_restart:
            log.warning("reload: %s changed but need a restart to take effect", ", ".join(self.pending_restart))

    async def _sync_schedules(self, settings: Settings) -> None:
        """Save the config's [[schedules]] (a failure is logged: the next start or SIGHUP tries again). Then
        say which stored schedules name a type this node does not define: it leaves them to a node that
        does, and with no such node (SQLite has one) they do not fire at all."""
        try:
            stored = await self.scheduler.sync_config(settings.schedules)
        except (InvalidRequest, StoreUnavailable) as exc:
            log.error("schedules from %s not saved: %s", self.config_path or "defaults", exc)
            return
        for schedule in stored:
            if not self.registry.knows_type(schedule.type):
                log.warning("schedule %s names task type %r, which this node does not define: it fires only on a "
                            "node that does", schedule.name, schedule.type)

    def _say_left_out(self, settings: Settings) -> None:
        """The built-in types plugins.allow/deny leave out: their tasks wait for a node that defines them."""
        left_out = sorted(set(BUILTIN_TYPES) - set(settings.all_types))
        if left_out:
            log.warning("built-in task types %s are not defined on this node: plugins.allow/deny leave out their "
                        "plugins", ", ".join(left_out))

    def _may_claim(self) -> bool:
        """Not while a host guard holds, nor on a node whose pool.task_types accepts none of its types (one
        that only takes submits for the fleet)."""
        return self.guards.ok() and bool(self._claim_filter().type_globs)

    def _claim_filter(self) -> ClaimFilter:
        """Types this node runs, tags its free slots carry (rule 2); asked before every claim, so cached.
        Each type is a glob matching its name alone (glob.escape): the store API takes globs."""
        version = self.resources.version
        if self._filter is None or self._filter[0] is not self.settings or self._filter[1] != version:
            types = tuple(glob.escape(name) for name in self.settings.claimed_types())
            self._filter = (self.settings, version, ClaimFilter(types, self.resources.free_tag_sets()))
        return self._filter[2]


async def serve(settings: Settings, *, config_path: Path | None = None, notifier: Notifier | None = None,
                when_drained: Callable[[], None] = lambda: None,
                task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    daemon = Daemon(settings, config_path=config_path, notifier=notifier, when_drained=when_drained)
    await daemon.run(task_status=task_status)


def check_startable(settings: Settings) -> None:
    """What a daemon of these settings would refuse before it starts anything, by the calls it starts with
    (`tidepool config check`): the store URL, each type's plugins with allow/deny, the resource slots, the
    API's token. Nothing is opened, bound or connected; ConfigError names what is wrong."""
    open_store(settings.store.url)
    _registry(settings)
    ResourcePool.from_settings(settings.resources)
    load_token(settings.api.token_file, settings.api.listen)
    check_state_dir(settings.node.state_dir)


def _file_safe(node_id: str) -> str:
    """A node id as part of a file name (node ids are free text)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", node_id)


@contextlib.contextmanager
def _locked(path: Path, held: str) -> Iterator[None]:
    """Hold an exclusive lock on `path` (with our pid in it); ConfigError saying `held` when another has it."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            other = handle.read().strip() or "unknown"
            raise ConfigError(f"{held} (pid {other}, lock {path}); stop it or give this daemon another "
                              "node.id") from None
        handle.truncate(0)
        handle.write(str(os.getpid()))
        handle.flush()
        yield


def check_state_dir(state_dir: Path) -> None:
    """node.state_dir holds the SQLite file and the plugins' work directories: created when missing, but
    a file there would fail every command plugin's attempt, one retry after another."""
    if state_dir.exists() and not state_dir.is_dir():
        raise ConfigError(f"config: node.state_dir: {state_dir} is not a directory")


def _registry(settings: Settings) -> Registry:
    return Registry.from_settings(settings.plugins, settings.all_types, kill_grace_s=settings.execution.kill_grace_s)


def _engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(timeout_s=settings.execution.timeout_s, stop_timeout_s=settings.execution.stop_timeout_s,
                        prepare_timeout_s=settings.execution.prepare_timeout_s)


def _pool_config(settings: Settings) -> PoolConfig:
    p = settings.pool
    return PoolConfig(p.min_workers, p.max_workers, p.idle_timeout_s, p.poll_interval_s, p.claim_batch)


def _reconciler_config(settings: Settings) -> ReconcilerConfig:
    return ReconcilerConfig(settings.reconciler.interval_s, settings.execution.cancel_deadline_s,
                            settings.reconciler.retention_days,
                            unserviceable_after_s=settings.execution.prepare_timeout_s)


def _changed_keys(old: Settings, new: Settings) -> list[str]:
    """`section.key` for every key of a section that differs; a whole table (types, resources) by name."""
    changed = []
    for name in type(old).model_fields:
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        if isinstance(before, settings_mod.Section):
            changed += [f"{name}.{key}" for key in type(before).model_fields
                        if getattr(before, key) != getattr(after, key)]
        else:
            changed.append(name)
    return changed


def _get(settings: Settings, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(settings, section), key)


def _quiet_gc() -> None:
    """Keep the collector off the task path (measured: ~8% of the event loop's time in a drain).

    A task allocates hundreds of short-lived objects: at the default threshold (700) a young collection
    ran every few tasks and every hundredth a full one over all that lives, the event ring included.
    What exists once the node is set up lives as long as the process, so it is frozen out of the scans.
    """
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)


def _loop_name() -> str:
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


def redacted(url: str) -> str:
    """The URL with its password, if any, as ***: for logs and messages. libpq takes one in the query too."""
    url = re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)
    return re.sub(r"([?&](?:ssl)?password=)[^&]*", r"\1***", url)


