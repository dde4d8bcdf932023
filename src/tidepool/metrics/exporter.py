"""The node's Prometheus exporter: counters and histograms fed by the event bus, gauges read at scrape time.

Every series whose label values are known is exported from the start, at zero: the task types this node
defines (read at each scrape, so a reload's new types appear too) by terminal state, the reconciler's
actions, the workers' kinds and reasons, and so on. The families come from a registry of this node's
own, so several daemons in one process (tests) do not clash. Durations are measured between event
timestamps. The gauges read at scrape time are the pool's workers and the host guards; the scans'
series count scans created and ended, and their steps ended, by profile (every profile this node defines
at zero before its first scan); the blobs' count bytes stored, received and sent (metrics.blobs).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from itertools import product
from typing import TYPE_CHECKING, Any, cast

import anyio
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from ..errors import StoreUnavailable
from ..events import Event, EventBus
from ..model import TERMINAL, Phase, State
from .blobs import BlobMetrics
from .series import UNKNOWN, Counter, Histogram, gauge

if TYPE_CHECKING:
    from ..execution.guards import GuardStats
    from ..execution.pool import PoolStats
    from ..store import Store
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..execution.guards import GuardStats
    from ..execution.pool import PoolStats


__all__ = ["CONTENT_TYPE", "Metrics"]

log = logging.getLogger("tidepool.metrics")
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the classic text format every Prometheus version reads
QUEUE_STATES = ("pending", "leased", "running", "retry_wait", "cancelling")
MAX_OPEN_ATTEMPTS = 100_000  # attempts whose end was never seen (store down at finish) must not pile up
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                    600.0, 1800.0, 3600.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   300.0)
KILL_REASONS = {"timeout": "timeout", "cancelled": "cancel"}  # error code -> plugin kill reason
LIMITS = ("memory_mb", "cpu_s", "nofile", "max_blob_bytes", "disk_mb")
# The label values each series is exported with from the start (task types are read at each scrape).
TERMINAL_STATES = tuple(sorted(state.value for state in TERMINAL))
RECONCILER_ACTIONS = ("expired", "promoted", "cancelled", "pruned", "unserviceable")
KILL_REASON_NAMES = (*KILL_REASONS.values(), *LIMITS, "limit", "lease_lost")
WORKER_KINDS = ("baseline", "demand")
WORKER_STOPS = ("idle", "retired", "shutdown")


class Metrics:
    """Everything /metrics shows for one node. Feed it with `metrics.attach(events)` (or, reading every
    event's data, `events.listen(metrics.on_event)`)."""

    def __init__(self, *, node_id: str, version: str, pool: Callable[[], PoolStats],
                 counts: Callable[[], Awaitable[dict[State, int]]],
                 guards: Callable[[], GuardStats | None] = lambda: None,
                 draining: Callable[[], bool] = lambda: False,
                 task_types: Callable[[], Iterable[str]] = lambda: (),
                 organizations: Callable[[], Awaitable[dict[str, int]]] | None = None,
                 profiles: Callable[[], Iterable[str]] = lambda: ()) -> None:
        self._info = (node_id, version)
        # Organizations are as many as a fleet has customers: a label of their own on the per-type counters
        # would multiply every type's series by them, so they get one gauge, read from the store at scrape.
        self._organization_counts = organizations
        self._organizations: dict[str, int] | None = None
        self._task_types = task_types
        self._profiles = profiles
        self._pool = pool
        self._counts = counts
        self._guards = guards
        self._draining = draining
        self._queue: dict[str, int] | None = None  # read by render() just before collecting

        self.created = Counter("tidepool_tasks_created", "Tasks created on this node (submitted to its API or "
                                "fired by a schedule), by type.", "type")
        self.finished = Counter("tidepool_tasks_finished", "Tasks that reached a terminal state on this node, by "
                                 "type and state.", "type", "state")
        self.retries = Counter("tidepool_task_retries", "Attempts that failed and left their task to retry.", "type")
        self.task_duration = Histogram("tidepool_task_duration_seconds", "Attempt duration on this node, "
                                        "initialize to recorded outcome, by type.", DURATION_BUCKETS, "type")
        self.phase_duration = Histogram("tidepool_phase_duration_seconds", "Time spent in each phase of an "
                                         "attempt.", DURATION_BUCKETS, "phase", known=[p.value for p in Phase])
        self.plugin_duration = Histogram("tidepool_plugin_duration_seconds", "Runs of plugins that succeeded.",
                                          DURATION_BUCKETS, "plugin")
        self.pickup_latency = Histogram("tidepool_pickup_latency_seconds", "From a task becoming claimable "
                                         "(created, retry due, released) to its lease.", LATENCY_BUCKETS, "type")
        self.lease_renewals = Counter("tidepool_lease_renewals", "Leases renewed.")
        self.lease_renewal_errors = Counter("tidepool_lease_renewal_errors", "Renewal writes that failed because "
                                             "the store was unavailable.")
        self.lease_losses = Counter("tidepool_lease_losses", "Attempts abandoned because their lease was lost.")
        self.reconciler_actions = Counter("tidepool_reconciler_actions", "Reconciler repairs: leases expired, "
                                           "retries promoted, cancels finished at their deadline, old tasks "
                                           "pruned.", "action", known=[(a,) for a in RECONCILER_ACTIONS])
        self.reconciler_passes = Counter("tidepool_reconciler_passes", "Reconciler passes done (one every "
                                          "reconciler.interval_s while the store answers).")
        self.reconciler_last_pass: float | None = None
        self.plugin_kills = Counter("tidepool_plugin_kills", "Running plugins stopped by tidepool, by reason "
                                     "(timeout, cancel, a limit, lease_lost).", "reason",
                                     known=[(r,) for r in KILL_REASON_NAMES])
        self.workers_started = Counter("tidepool_workers_started", "Worker coroutines started, by kind.", "kind",
                                        known=[(k,) for k in WORKER_KINDS])
        self.workers_stopped = Counter("tidepool_workers_stopped", "Worker coroutines stopped, by kind and reason.",
                                        "kind", "reason", known=product(WORKER_KINDS, WORKER_STOPS))
        self.reloads = Counter("tidepool_config_reloads", "SIGHUP reloads, applied or rejected.", "result",
                                known=[("ok",), ("rejected",)])
        self.schedule_fired = Counter("tidepool_schedule_fired", "Schedule ticks that created a task, by schedule.",
                                       "schedule")
        self.schedule_skipped = Counter("tidepool_schedule_skipped", "Schedule ticks skipped, by schedule and "
                                         "reason (overlap, missed, queue_full, refused).", "schedule", "reason")
        self.scans = ScanMetrics()
        self.scans_created, self.scans_finished, self.scan_steps = self.scans.series
        self.blobs = BlobMetrics()
        self._series = (self.created, self.finished, self.retries, self.task_duration, self.phase_duration,
                        self.plugin_duration, self.pickup_latency, self.lease_renewals, self.lease_renewal_errors,
                        self.lease_losses, self.reconciler_actions, self.reconciler_passes, self.plugin_kills,
                        self.workers_started, self.workers_stopped, self.reloads, self.schedule_fired,
                        self.schedule_skipped, *self.scans.series, *self.blobs.series)
        self._tripped = dict.fromkeys(GUARDS, 0)
        # task id -> [attempt start, current phase, phase start, stopped while a plugin ran]
        self._open: dict[str, list[Any]] = {}
        self._failed_handlers: set[str] = set()
        self._handlers: dict[str, Callable[[dict[str, Any], float], None]] = {
            "task.created": self._task_created,
            "task.leased": self._task_leased,
            "task.phase": self._task_phase,
            "plugin.finished": self._plugin_finished,
            "task.retry_scheduled": self._task_retry_scheduled,
            "task.finished": self._task_finished,
            "task.lease_lost": self._task_lease_lost,
            "task.expired": self._task_expired,
            "reconciler.pass": self._reconciler_pass,
            "worker.started": self._worker_started,
            "worker.stopped": self._worker_stopped,
            "guard.tripped": self._guard_tripped,
            "guard.cleared": self._guard_cleared,
            "schedule.fired": self._schedule_fired,
            "schedule.skipped": self._schedule_skipped,
            **self.scans.handlers,
        }

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    # feeding

    def attach(self, bus: EventBus) -> None:
        """Count what the bus publishes: a task's own steps from their bare arguments (no event data is built
        for the metrics), every other event from its data."""
        tallies: dict[str, Callable[..., None]] = {
            "task.leased": self._leased, "task.phase": self._phase_entered, "plugin.finished": self._plugin_ran,
            "task.finished": self._finished}
        for name, tally in tallies.items():
            bus.tally(name, tally)
        bus.listen(self.on_event, names=[name for name in self._handlers if name not in tallies])

    def on_event(self, event: Event) -> None:
        """The event bus listener: O(1) per event, and never raises into the code that published."""
        handler = self._handlers.get(event.name)
        if handler is None:
            return
        try:
            handler(event.data, event.ts)
        except Exception:
            if event.name not in self._failed_handlers:  # once per event name, not once per task
                self._failed_handlers.add(event.name)
                log.exception("metrics: cannot count event %s %r", event.name, event.data)

    def reloaded(self, *, ok: bool) -> None:
        self.reloads.inc(("ok" if ok else "rejected",))

    def lease_store(self, store: Store) -> Store:
        """`store` as the lease keeper should see it: every call passes through, renewals are counted."""
        return cast("Store", _CountingRenewals(store, self))

    def _task_created(self, d: dict[str, Any], ts: float) -> None:
        if not d.get("retry"):
            self.created.inc((d.get("type") or UNKNOWN,))

    def _task_leased(self, d: dict[str, Any], ts: float) -> None:
        self._leased(ts, d.get("task_id"), d.get("worker_id"), d.get("attempt_id"), d.get("attempt"), d.get("type"),
                     d.get("available_at"))

    def _leased(self, ts: float, task_id: object, worker_id: object, attempt_id: object, attempt: object,
                task_type: str | None, available_at: float | None) -> None:
        if available_at is not None:
            self.pickup_latency.observe(task_type or UNKNOWN, ts - available_at)

    def _task_phase(self, d: dict[str, Any], ts: float) -> None:
        self._phase_entered(ts, d["task_id"], d.get("worker_id"), d["phase"], d.get("attempt_id"))

    def _phase_entered(self, ts: float, task_id: str, worker_id: object, phase: str, attempt_id: object) -> None:
        if phase == "initialize":
            if len(self._open) >= MAX_OPEN_ATTEMPTS:
                self._open.clear()
            self._open[task_id] = [ts, phase, ts, False]
            return
        attempt = self._open.get(task_id)
        if attempt is None:
            return
        self.phase_duration.observe(attempt[1], ts - attempt[2])
        if phase == "stop":
            attempt[3] = attempt[1] == "run"
        attempt[1], attempt[2] = phase, ts

    def _plugin_finished(self, d: dict[str, Any], ts: float) -> None:
        self._plugin_ran(ts, d.get("task_id"), d.get("worker_id"), d.get("plugin"), d.get("duration_s"),
                         d.get("outcome"))

    def _plugin_ran(self, ts: float, task_id: object, worker_id: object, plugin: Any, duration_s: float | None,
                    outcome: str | None) -> None:
        if duration_s is not None and outcome == "succeeded":  # what the histogram says it counts
            self.plugin_duration.observe(plugin, duration_s)

    def _task_retry_scheduled(self, d: dict[str, Any], ts: float) -> None:
        task_type = d.get("type") or UNKNOWN
        self.retries.inc((task_type,))
        self._attempt_ended(d["task_id"], d.get("error"), ts, task_type)

    def _task_finished(self, d: dict[str, Any], ts: float) -> None:
        self._finished(ts, d["task_id"], d.get("worker_id"), d.get("state"), d.get("error"), d.get("type"))

    def _finished(self, ts: float, task_id: str, worker_id: str | None, state: str | None,
                  error: dict[str, Any] | None, task_type: str | None) -> None:
        task_type = task_type or UNKNOWN
        self.finished.inc((task_type, state or UNKNOWN))
        if worker_id is not None:  # ended by its worker here, not by the reconciler or an API cancel
            self._attempt_ended(task_id, error, ts, task_type)

    def _task_lease_lost(self, d: dict[str, Any], ts: float) -> None:
        self.lease_losses.inc(())
        self._attempt_ended(d["task_id"], d.get("error"), ts, d.get("type") or UNKNOWN, lost=True)

    def _attempt_ended(self, task_id: str, error: dict[str, Any] | None, ts: float, task_type: str, *,
                       lost: bool = False) -> None:
        attempt = self._open.pop(task_id, None)
        if attempt is None:
            return
        self.phase_duration.observe(attempt[1], ts - attempt[2])
        self.task_duration.observe(task_type, ts - attempt[0])
        if attempt[3]:  # a plugin was running when the attempt was stopped: was it stopped by us?
            reason = "lease_lost" if lost else _kill_reason(error)
            if reason is not None:
                self.plugin_kills.inc((reason,))

    def _task_expired(self, d: dict[str, Any], ts: float) -> None:
        self.reconciler_actions.inc(("expired",))

    def _reconciler_pass(self, d: dict[str, Any], ts: float) -> None:
        self.reconciler_passes.inc(())
        self.reconciler_last_pass = ts
        for action in RECONCILER_ACTIONS[1:]:  # "expired" is counted per task.expired
            if d.get(action):
                self.reconciler_actions.inc((action,), d[action])

    def _worker_started(self, d: dict[str, Any], ts: float) -> None:
        self.workers_started.inc((d.get("kind") or UNKNOWN,))

    def _worker_stopped(self, d: dict[str, Any], ts: float) -> None:
        self.workers_stopped.inc((d.get("kind") or UNKNOWN, d.get("reason") or UNKNOWN))

    def _guard_tripped(self, d: dict[str, Any], ts: float) -> None:
        self._tripped[d["guard"]] = 1

    def _schedule_fired(self, d: dict[str, Any], ts: float) -> None:
        self.schedule_fired.inc((d["schedule"],))

    def _schedule_skipped(self, d: dict[str, Any], ts: float) -> None:
        self.schedule_skipped.inc((d["schedule"], d["reason"]), d.get("count", 1))

    def _guard_cleared(self, d: dict[str, Any], ts: float) -> None:
        self._tripped[d["guard"]] = 0

    # scraping

    async def render(self) -> bytes:
        """The text exposition; reads the queue depth from the store first (at most 5 s)."""
        try:
            with anyio.fail_after(5.0):
                counts = await self._counts()
            self._queue = {state: counts.get(State(state), 0) for state in QUEUE_STATES}
        except (StoreUnavailable, TimeoutError):
            self._queue = None
        self._organizations = None
        if self._organization_counts is not None and self._queue is not None:
            try:
                with anyio.fail_after(5.0):
                    self._organizations = await self._organization_counts()
            except (StoreUnavailable, TimeoutError):
                pass
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        yield gauge("tidepool_info", "This node: its id and the tidepool version.", {"node_id": self._info[0],
                                                                                  "version": self._info[1]}, 1)
        yield from pool_families(self._pool(), draining=self._draining())
        store_up = self._queue is not None
        yield gauge("tidepool_store_up", "1 if the store answered the last scrape's queue query.", {}, store_up)
        if self._queue is not None:
            queue = GaugeMetricFamily("tidepool_queue_depth", "Unfinished tasks in the store, by state.",
                                      labels=["state"])
            for state, n in self._queue.items():
                queue.add_metric([state], n)
            yield queue
        if self._organizations is not None:
            by_organization = GaugeMetricFamily("tidepool_tasks_by_organization", "Unfinished tasks in the store, "
                                                "by organization.", labels=["organization"])
            for organization, n in sorted(self._organizations.items()):
                by_organization.add_metric([organization], n)
            yield by_organization
        yield from guard_families(self._guards(), self._tripped)
        self._know_task_types()
        for series in self._series:
            yield series.family()
        if self.reconciler_last_pass is not None:
            yield gauge("tidepool_reconciler_last_pass_timestamp_seconds",
                        "When the last reconciler pass ended (Unix time): an alert can tell a stalled one.", {},
                        self.reconciler_last_pass)

    def _know_task_types(self) -> None:
        """Each type and profile this node defines (now: a reload may add some) gets its series before its first use."""
        types = list(self._task_types())
        for counter in (self.created, self.retries):
            counter.know((t,) for t in types)
        self.finished.know(product(types, TERMINAL_STATES))
        for histogram in (self.task_duration, self.pickup_latency):
            histogram.know(types)
        self.scans.know(self._profiles())

class _Collector:
    """Hands the registry the families of a Metrics object at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.collect()


class _CountingRenewals:
    """The store as the lease keeper sees it. leases.py knows nothing of metrics; counting at the
    store boundary keeps it that way and costs one addition per renewal batch."""

    def __init__(self, store: Store, metrics: Metrics) -> None:
        self._store = store
        self._metrics = metrics

    async def renew(self, leases: Sequence[Any], *, now: float, lease_s: float) -> dict[str, Any]:
        try:
            lost = await self._store.renew(leases, now=now, lease_s=lease_s)
        except StoreUnavailable:
            self._metrics.lease_renewal_errors.inc(())
            raise
        self._metrics.lease_renewals.inc((), len(leases) - len(lost))
        return lost

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _kill_reason(error: dict[str, Any] | None) -> str | None:
    if not error:
        return None
    code = error.get("code")
    if code == "limit_exceeded":  # LimitExceeded's message starts with the limit's name
        limit = str(error.get("message", "")).partition(" ")[0]
        return limit if limit in LIMITS else "limit"
    return KILL_REASONS.get(code or "")


GUARDS = ("memory", "disk")


def pool_families(stats: PoolStats, *, draining: bool) -> Iterator[Metric]:
    workers = GaugeMetricFamily("tidepool_workers", "Live worker coroutines, by kind.", labels=["kind"])
    workers.add_metric(["baseline"], stats.baseline)
    workers.add_metric(["demand"], stats.demand)
    yield workers
    yield gauge("tidepool_workers_busy", "Workers executing a task.", {}, stats.busy)
    yield gauge("tidepool_pool_min_workers", "pool.min_workers now in force.", {}, stats.min_workers)
    yield gauge("tidepool_pool_max_workers", "pool.max_workers now in force.", {}, stats.max_workers)
    yield gauge("tidepool_pool_claiming", "1 while the pool claims work.", {}, stats.claiming)
    yield gauge("tidepool_draining", "1 once shutdown began.", {}, draining)


def guard_families(stats: GuardStats | None, tripped_by_events: dict[str, int]) -> Iterator[Metric]:
    """What the guards measured; without their statistics, what their events said."""
    tripped = dict(tripped_by_events) if stats is None else {g: int(g in stats.tripped) for g in GUARDS}
    family = GaugeMetricFamily("tidepool_guard_tripped", "1 while a host guard stops claiming.",
                               labels=["guard"])
    for guard, value in tripped.items():
        family.add_metric([guard], value)
    yield family
    if stats is not None:
        free = GaugeMetricFamily("tidepool_guard_free_bytes", "Free memory and state-directory disk, as "
                                 "last measured by the guards.", labels=["guard"])
        for guard, mb in (("memory", stats.free_memory_mb), ("disk", stats.free_disk_mb)):
            if mb is not None:
                free.add_metric([guard], mb * 2**20)
        yield free


SCAN_ENDS = ("cancelled", "failed", "succeeded")
JOB_ENDS = ("cancelled", "failed", "success", "timeout")  # a job skipped is told by its scan's end


class ScanMetrics:
    def __init__(self) -> None:
        self.created = Counter("tidepool_scans_created", "Scans created on this node (submitted to its API "
                               "or started by a schedule), by profile.", "profile")
        self.finished = Counter("tidepool_scans_finished", "Scans that ended, by profile and state, as this "
                                "node saw them end.", "profile", "state")
        self.steps = Counter("tidepool_scan_steps_finished", "Scan steps (jobs) that ended, by profile and the "
                             "job's state, as this node saw them end.", "profile", "state")
        self.series = (self.created, self.finished, self.steps)
        self.handlers: dict[str, Callable[[dict[str, Any], float], None]] = {
            "scan.created": self._scan_created,
            "scan.step": self._scan_step,
            "scan.finished": self._scan_finished,
        }

    def know(self, profiles: Iterable[str]) -> None:
        profiles = list(profiles)
        self.created.know((p,) for p in profiles)
        self.finished.know(product(profiles, SCAN_ENDS))
        self.steps.know(product(profiles, JOB_ENDS))

    def _scan_created(self, d: dict[str, Any], ts: float) -> None:
        self.created.inc((d.get("profile") or UNKNOWN,))

    def _scan_step(self, d: dict[str, Any], ts: float) -> None:
        if d.get("state") in JOB_ENDS:  # a step's task queued is counted as a task created
            self.steps.inc((d.get("profile") or UNKNOWN, d["state"]))

    def _scan_finished(self, d: dict[str, Any], ts: float) -> None:
        self.finished.inc((d.get("profile") or UNKNOWN, d.get("state") or UNKNOWN))
