"""The daemon: one node built from its settings (the composition root), run, drained on SIGTERM, reloaded
on SIGHUP.

A remote worker is built of the same parts but its store, which is its gateway: it runs no upkeep (no
reconciler, scheduler, heartbeat or watch for gone nodes), since those run where the queue is."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import anyio
from anyio.abc import TaskGroup, TaskStatus

from .. import __version__, logs
from .. import settings as settings_mod
from ..api import load_token, serve_api
from ..errors import ConfigError, StoreUnavailable
from ..events import EventBus, first_id_of_this_run
from ..execution.claims import Claims
from ..execution.engine import Engine, EngineConfig
from ..execution.guards import Guards
from ..execution.leases import LeaseKeeper
from ..execution.outcomes import UnwrittenInterruptions
from ..execution.pool import Pool, PoolConfig
from ..execution.resources import ResourcePool
from ..execution.workdirs import clear_leftovers
from ..gateway.openapi import WORKER_PROTOCOL
from ..metrics.exporter import Metrics
from ..model import QUEUED, AttemptStatus, new_id
from ..plugins import Registry, command
from ..settings import Settings
from ..store import Node, open_store
from ..store.remote import RemoteStore
from ..upkeep.fleet import GoneNodes, Heartbeat, fence_after_s
from ..upkeep.reconciler import Reconciler, ReconcilerConfig
from ..upkeep.scheduler import Scheduler
from . import reload
from .gateway import NodeGateway, WakerWithGateway
from .lock import file_safe, node_lock
from .operations import NodeOperations, NodeParts, NodeStatus, store_answers
from .remote import RemoteOperations, attach_remote
from .startup import keep_private, plugin_registry, redacted, say_left_out
from .systemd import Notifier, report_status, run_watchdog

log = logging.getLogger("tidepool.service")
OUTCOME_FLUSH_S = 10.0  # at shutdown, after the drain and the stop phases, for outcomes a slow store still holds
RELOAD_SYNC_S = 5.0  # a SIGHUP saves the config's schedules within this, or leaves them to the next one
GC_YOUNG_THRESHOLD = 20_000


class Daemon:
    """One node: store, pool, engine, leases, reconciler, scheduler and API, wired from one Settings."""

    def __init__(self, settings: Settings, *, config_path: Path | None = None,
                 notifier: Notifier | None = None, when_drained: Callable[[], None] = lambda: None) -> None:
        self.settings = settings
        self._boot_settings = settings  # what the running store, API and node were built from
        self.config_path = config_path
        self.notifier = notifier or Notifier()
        self._when_drained = when_drained  # every outcome written: see cli's bounded exit
        self.node_id = settings.node.node_id
        self.instance_id = new_id()
        self.started_at = time.time()
        self.status = NodeStatus()
        self.store = open_store(settings.store.url, section=settings.store, artifacts=settings.artifacts,
                                blob_dir=settings.node.state_dir / "blobs")
        # A remote worker: its store is a gateway, which runs the reconciler and scheduler where the queue is.
        self.remote = self.store if isinstance(self.store, RemoteStore) else None
        self.events = EventBus(first_id=first_id_of_this_run())
        # Absolute: a command runs in its work directory, where a relative {workdir} (state_dir = "./var",
        # the example's) would not resolve.
        self.work_root = settings.node.state_dir.absolute() / "work" / file_safe(self.node_id)
        self._build(settings, plugin_registry(settings))
        self.heartbeat = Heartbeat(self.store, self._describe, interval_s=settings.node.heartbeat_s,
                                   on_saved=self.leases.heard)
        self.gone_nodes = GoneNodes(self.store, node_id=self.node_id, policy=lambda: self.engine.policy,
                                    report=self.reconciler.report_expired, fleet_seen=self.leases.fleet_seen)
        # Several nodes may share a state dir (one SQLite file, several node ids): each keeps its own.
        self._unwritten = UnwrittenInterruptions(
            settings.node.state_dir / f"unwritten-interruptions.{file_safe(self.node_id)}.json")
        self._shutdown = anyio.Event()
        self._forced = False
        self._reload_when_ready = False  # a SIGHUP came while the node was starting
        self._drain_wait: anyio.CancelScope | None = None  # a second SIGINT cuts the current wait short

    def _build(self, settings: Settings, registry: Registry) -> None:
        """The parts, each after what it needs. One waker first: a freed slot, a cleared guard, a submit, a
        promoted retry, a schedule's tick and another node's submit all mean claimable work may be waiting."""
        self.waker = WakerWithGateway(also=lambda n: self.gateway.wake(n))  # remote workers' parked acquires too
        self.node_gateway = NodeGateway(self.store, self.events, settings, policy=lambda: self.engine.policy)
        self.gateway = self.node_gateway.gateway
        self.guards = Guards(self.events, state_dir=settings.node.state_dir,
                             min_free_memory_mb=settings.guards.min_free_memory_mb,
                             min_free_disk_mb=settings.guards.min_free_disk_mb, on_clear=self.waker.wake_max)
        self.resources = ResourcePool.from_settings(settings.resources, on_free=self.waker.wake)
        # The pool's figures are read at scrape time: the pool is built below, after the lease keeper that
        # counts its renewals through these metrics.
        self.metrics = Metrics(node_id=self.node_id, version=__version__, pool=lambda: self.pool.statistics(),
                               counts=partial(store_answers, self.store), guards=self.guards.statistics,
                               draining=lambda: self.status.draining, task_types=lambda: self.ops.registry.types,
                               organizations=self.store.organization_counts,
                               profiles=lambda: self.ops.scans.profiles)
        self.metrics.attach(self.events)
        self.metrics.registry.register(self.gateway.metrics)
        logs.attach(self.events)
        self.leases = LeaseKeeper(self.metrics.lease_store(self.store), lease_s=settings.lease.duration_s,
                                  renew_every_s=settings.lease.renew_every_s,
                                  fence_after_s=fence_after_s(settings.node.heartbeat_s),
                                  on_fence=partial(_hurry_commands, settings.node.heartbeat_s))
        self.engine = Engine(self.store, registry, self.leases, self.events,
                             config=EngineConfig.of(settings.execution, settings.artifacts),
                             policy=settings.retry.policy(), work_root=self.work_root, resources=self.resources)
        self.claims = Claims(settings.claimed_types(), resources=self.resources, guards=self.guards)
        self.pool = Pool(self.store, self.engine, self.leases, self.events, config=PoolConfig.of(settings.pool),
                         node_id=self.node_id, instance_id=self.instance_id, claim_filter=self.claims.filter,
                         promise_slots=self.resources.claiming, may_claim=self._may_claim, waker=self.waker)
        self.ops = (NodeOperations if self.remote is None else RemoteOperations)(settings, registry, NodeParts(
            self.store, self.events, self.waker, self.pool, self.leases, self.guards, self.resources, self.metrics,
            self.gateway.registry),
            node_id=self.node_id, status=self.status)
        # A scan step's next task is made by whichever call ended the step before it, not by a submit: the
        # store's one listener announces each move and wakes a worker for each task it made.
        self.store.on_scan_moves(self.ops.scans.moved)
        self.reconciler = Reconciler(self.store, self.events,
                                     config=ReconcilerConfig.of(settings.reconciler, settings.execution,
                                                                settings.all_types, settings.artifacts),
                                     policy=lambda: self.engine.policy, wake=self.waker.wake,
                                     fleet_tags=self.ops.fleet_tag_sets)
        self.scheduler = Scheduler(self.store, self.events, node_id=self.node_id, new_task=self.ops.scheduled_task,
                                   wake=self.waker.wake, defines=self.ops.defines,
                                   max_queued=settings.pool.max_queued, scan_started=self.ops.scans.announce)
        if self.remote is not None:
            attach_remote(self.remote, self.leases, self.waker)

    # running

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Open the store, start every part, then READY=1; on shutdown drain, stop and close the store.

        The API is bound before the pool starts, so a node that cannot bind its address exits having
        claimed nothing; READY=1 goes out once the pool's baseline workers run as well.
        """
        token = load_token(self.settings.api.token_file, self.settings.api.listen)
        keep_private(self.settings)
        self.node_gateway.read_credentials(self.settings)
        with node_lock(self.node_id, work_root=self.work_root, db_path=self.settings.db_path()):
            await self.store.open(migrate=self.settings.store.migrate)
            try:
                await self._recover()
                async with anyio.create_task_group() as tg:
                    await self._start(tg, token)
                    task_status.started()
                    if self._reload_when_ready:
                        tg.start_soon(self.reload)
                    await self._shutdown.wait()
                    await self._drain()
                    if self.remote is None:
                        await self.heartbeat.leave()
                    tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    await self.store.close()
        log.info("node %s stopped", self.node_id)

    async def _recover(self) -> None:
        """Before any part starts: hold the node id, end what an earlier process of it left behind, save the
        config's schedules."""
        if self.remote is not None:  # its attempts and schedules are the gateway's: only this host's leftovers
            await clear_leftovers(self.work_root)
            self.remote.keep_inputs(self.settings.node.state_dir.absolute() / "cache",
                                    cache_mb=self.settings.artifacts.cache_mb)
            return
        await self.store.lock_node(self.node_id, self.instance_id)  # PostgreSQL: one process per node id
        await self.reconciler.recover(node_id=self.node_id, instance_id=self.instance_id,
                                      interrupted=self._unwritten.read())
        self._unwritten.forget()  # written now (or their leases were gone already)
        say_left_out(self.settings)
        await self._sync_schedules(self.settings)
        await clear_leftovers(self.work_root)

    async def _start(self, tg: TaskGroup, token: str | None) -> None:
        await tg.start(self._handle_signals)  # first: from here on a SIGTERM drains, never kills
        await tg.start(self.leases.run)
        await tg.start(partial(self.store.watch, self.waker.wake))  # other nodes' submits wake us
        if self.remote is None:  # the fleet's rows live in the store; a gateway knows its workers by their calls
            await tg.start(self.heartbeat.run)
        await tg.start(self.guards.run)  # a first measure before the first claim
        await tg.start(partial(serve_api, self.ops, self.settings.api.listen, token=token,
                               worker_protocol=WORKER_PROTOCOL))
        await self.node_gateway.start(tg, self.settings)
        _quiet_gc()
        await tg.start(self.pool.run)
        if self.remote is None:  # a remote worker's gateway runs these, where the store is
            await tg.start(self.reconciler.run)
            await tg.start(self.gone_nodes.run)
            await tg.start(self.scheduler.run)
        tg.start_soon(report_status, self.notifier, self._status_line)
        tg.start_soon(self._watchdog)
        self.status.ready = True  # /readyz answers 200 from here: before systemd hears READY=1
        self.notifier.ready()
        log.info("node %s ready: tidepool %s on %s, store %s, api %s, workers %d..%d; %s%s", self.node_id,
                 __version__, _loop_name(), redacted(self.settings.store.url), self.settings.api.listen,
                 self.pool.config.min_workers, self.pool.config.max_workers, self.settings.ready_summary(),
                 f"; gateway https://{self.settings.gateway.listen}" if self.node_gateway.credentials else "")

    def shutdown(self) -> None:
        self._shutdown.set()

    async def _drain(self) -> None:
        """Stop claiming (batch-claimed tasks not started yet go back at once), let running tasks finish
        within drain_timeout_s, then interrupt the rest through their cancel scopes: their stop phases
        run and each attempt is recorded `interrupted`, its task back to pending without using an attempt."""
        self.status.draining = True
        self.notifier.stopping()
        self.pool.stop_claiming()
        if self.remote is not None:
            self.remote.stop_acquiring()  # an acquire parked at the gateway comes back now
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
        self._keep_unwritten()
        self._when_drained()
        self.events.close()

    def _keep_unwritten(self) -> None:
        """Interruptions the store did not take are kept for the next start to write."""
        if unwritten := self.engine.outcomes.unwritten():
            self._unwritten.keep(p.held.lease.attempt_id for p in unwritten
                                 if p.outcome.status is AttemptStatus.INTERRUPTED)
            log.warning("node %s: %d outcomes not written; their leases expire by time (interruptions are "
                        "written by the next start)", self.node_id, len(unwritten))

    async def _handle_signals(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP and not self.status.ready:  # READY=1 must wait for the node
                    log.info("SIGHUP while starting: the config is read again once the node is ready")
                    self._reload_when_ready = True
                elif signum == signal.SIGHUP:
                    await self.reload()
                elif self._shutdown.is_set() and signum == signal.SIGINT:
                    self._force()
                elif self._shutdown.is_set():
                    log.info("received %s: already shutting down", signal.Signals(signum).name)
                else:
                    log.info("received %s: shutting down", signal.Signals(signum).name)
                    self._shutdown.set()

    def _force(self) -> None:
        """A second SIGINT: stop waiting for running tasks."""
        log.warning("second SIGINT: interrupting running tasks now")
        self._forced = True
        for h in self.leases.held():
            h.stop("interrupt")
        if self._drain_wait is not None:
            self._drain_wait.cancel()

    async def _status_line(self) -> str:
        """STATUS=, as systemctl status shows it."""
        stats = self.pool.statistics()
        try:
            counts = await self.store.counts()
            queued = sum(counts.get(s, 0) for s in QUEUED)
        except StoreUnavailable:
            queued = -1
        text = f"workers {stats.workers}/{stats.max_workers} busy {stats.busy} queued {queued}"
        return ("draining: " if self.status.draining else "") + text

    async def _watchdog(self) -> None:
        allowed_lag = max(5.0, self.pool.config.poll_interval_s * 3)
        await run_watchdog(self.notifier, is_alive=lambda: time.monotonic() - self.pool.last_tick < allowed_lag)

    def _may_claim(self) -> bool:
        return self.claims.allowed() and not self.leases.fencing()

    def _describe(self, now: float) -> Node:
        """This node as the registry records it, with the figures that change live."""
        s = self.settings
        tags = tuple(tuple(sorted(r.tags)) for r in self._boot_settings.resources.values())
        return Node(self.node_id, self.instance_id, socket.gethostname(), os.getpid(), __version__, self.started_at,
                    now, self.heartbeat.interval_s, tuple(s.claimed_types()), tags, self.pool.config.max_workers)

    # reload

    async def reload(self) -> None:
        """SIGHUP: apply what can change live; keep the old config when the new file is invalid.

        RELOADING=1 goes out before the file is read and READY=1 after, whatever happened: without
        it `systemctl reload` hangs until its timeout.
        """
        if self.status.draining:
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
            registry = plugin_registry(new)
            if self.remote is not None:  # a rotated certificate is presented from the next connection on
                self.remote.use_certificates(cert_file=new.store.cert_file, key_file=new.store.key_file,
                                             ca_file=new.store.ca_file)
                self.remote.keep_inputs(self.settings.node.state_dir.absolute() / "cache",
                                        cache_mb=new.artifacts.cache_mb)  # node.state_dir takes a restart
        except Exception as exc:  # a plugin module may raise anything on import: the node must live on
            self.metrics.reloaded(ok=False)
            log.error("reload of %s rejected, keeping the running config: %s", where, reload.rejection(exc),
                      exc_info=not isinstance(exc, ConfigError))
            return
        changed = reload.changed_keys(self.settings, new)
        self.status.pending_restart = reload.needs_restart(self._boot_settings, new)
        logs.setup(new.log.level, new.log.format)
        if self._configure(new, registry) and not any(k in changed for k in reload.POOL_SIZES):
            changed.append("pool sizes (back to the file's from PATCH /v1/pool)")
        self.settings = new
        say_left_out(new)
        # Even when the file did not change: an API save or delete since may have taken a schedule from it,
        # and a SIGHUP is how an operator puts the file's back. Bounded: the signal handler waits
        # for this, and a SIGTERM must not wait behind a store that does not answer.
        await self._sync_schedules(new, timeout_s=RELOAD_SYNC_S)
        self.metrics.reloaded(ok=True)
        log.info("reloaded %s: %s", where, ", ".join(changed) if changed else "nothing changed")
        if self.status.pending_restart:
            log.warning("reload: %s changed but need a restart to take effect", ", ".join(self.status.pending_restart))

    def _configure(self, new: Settings, registry: Registry) -> bool:
        """Each part takes its own sections of the new settings; whether the pool's sizes changed."""
        self.ops.configure(new, registry)  # submits check types against the new ones too
        self.engine.configure(registry, new.execution, new.retry, new.artifacts)
        if self.remote is None:  # a remote worker's leases last as its gateway says
            self.leases.configure(lease_s=new.lease.duration_s, renew_every_s=new.lease.renew_every_s)
        self.reconciler.configure(new.reconciler, new.execution, new.all_types, new.artifacts)
        self.guards.configure(new.guards)
        self.claims.configure(new.claimed_types())
        self.scheduler.configure(new.pool)
        self.node_gateway.configure(new)
        return self.pool.configure(new.pool)

    async def _sync_schedules(self, settings: Settings, *, timeout_s: float = math.inf) -> None:
        if self.remote is not None:
            return
        await self.scheduler.save_config(settings.schedules, source=str(self.config_path or "defaults"),
                                         timeout_s=timeout_s, check=self.ops.check_schedule)


async def serve(settings: Settings, *, config_path: Path | None = None, notifier: Notifier | None = None,
                when_drained: Callable[[], None] = lambda: None,
                task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    daemon = Daemon(settings, config_path=config_path, notifier=notifier, when_drained=when_drained)
    await daemon.run(task_status=task_status)


def _hurry_commands(heartbeat_s: float) -> None:
    """A fencing node's commands get SIGKILL within half a heartbeat, whatever their kill_grace_s: the
    fleet may call the node gone one heartbeat after the fence, and run its tasks elsewhere."""
    command.hurry(time.monotonic() + heartbeat_s / 2)


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

