"""/metrics: what the event bus feeds in comes out in the Prometheus text format, parsed back with
prometheus_client's own parser; gauges are read when scraped; a bad event never reaches the publisher."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tidepool.errors import StoreUnavailable
from tidepool.events import EventBus
from tidepool.execution.guards import GuardStats
from tidepool.execution.pool import PoolStats
from tidepool.metrics.exporter import Metrics
from tidepool.model import Lease, State, new_id

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def pool_stats(**overrides: Any) -> PoolStats:
    fields: dict[str, Any] = dict(min_workers=2, max_workers=8, idle_timeout_s=30.0, workers=5, busy=3,
                                  baseline=2, demand=3, claiming=True)
    return PoolStats(**{**fields, **overrides})


async def counts() -> dict[State, int]:
    return {State.PENDING: 12, State.RUNNING: 3}


def make_metrics(**kwargs: Any) -> tuple[Metrics, EventBus, Clock]:
    clock = Clock()
    bus = EventBus(clock=clock)
    metrics = Metrics(node_id="node-a", version="9.9", pool=lambda: pool_stats(), counts=counts, **kwargs)
    bus.listen(metrics.on_event)
    return metrics, bus, clock


async def scrape(metrics: Metrics) -> Samples:
    text = (await metrics.render()).decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def run_attempt(bus: EventBus, clock: Clock, task_id: str, *, phases: Sequence[tuple[str, float]],
                end: tuple[str, dict[str, Any]], worker: str = "node-a/w1") -> None:
    """Publish an attempt as the pool and engine do: each phase entered after the given seconds."""
    for phase, after_s in phases:
        clock.now += after_s
        bus.publish("task.phase", task_id=task_id, worker_id=worker, phase=phase, attempt_id="a")
    name, data = end
    bus.publish(name, task_id=task_id, worker_id=worker, **data)


async def test_task_events_move_counters_and_histograms() -> None:
    metrics, bus, clock = make_metrics()
    ok, slow, fat, lost = new_id(), new_id(), new_id(), new_id()
    for task_id, task_type in ((ok, "noop"), (slow, "scan"), (fat, "scan"), (lost, "scan")):
        bus.publish("task.created", task_id=task_id, worker_id=None, type=task_type, priority=0)
    bus.publish("task.created", task_id=ok, worker_id=None, type="noop", retry=True)  # a retry is no new task
    bus.publish("task.leased", task_id=ok, worker_id="w1", attempt_id="a", attempt=1, type="noop",
                available_at=clock.now - 0.003)
    run_attempt(bus, clock, ok, phases=[("initialize", 0), ("prepare", 0.001), ("run", 0.001), ("stop", 0.2)],
                end=("task.finished", {"state": "completed", "error": None, "type": "noop"}))
    timeout = {"code": "timeout", "message": "plugin nmap timed out after 300.0s"}
    run_attempt(bus, clock, slow, phases=[("initialize", 0), ("prepare", 0), ("run", 0), ("stop", 3.0)],
                end=("task.retry_scheduled", {"error": timeout, "attempt": 1, "type": "scan"}))
    run_attempt(bus, clock, slow, phases=[("initialize", 5), ("prepare", 0), ("run", 0), ("stop", 3.0)],
                end=("task.finished", {"state": "timed_out", "error": timeout, "type": "scan"}))
    limit = {"code": "limit_exceeded", "message": "memory_mb exceeded: the process tree used 600 MiB of 512"}
    run_attempt(bus, clock, fat, phases=[("initialize", 0), ("prepare", 0), ("run", 0), ("stop", 1.0)],
                end=("task.finished", {"state": "failed", "error": limit, "type": "scan"}))
    run_attempt(bus, clock, lost, phases=[("initialize", 0), ("prepare", 0), ("run", 0), ("stop", 1.0)],
                end=("task.lease_lost", {"attempt_id": "a", "type": "scan"}))
    bus.publish("plugin.finished", task_id=ok, worker_id="w1", plugin="noop", duration_s=0.0004, outcome="succeeded")
    for outcome in ("failed", "timed_out", "stopped"):  # not runs that succeeded: not in the histogram
        bus.publish("plugin.finished", task_id=slow, worker_id="w1", plugin="noop", duration_s=1.0, outcome=outcome)

    s = await scrape(metrics)
    assert value(s, "tidepool_tasks_created_total", type="noop") == 1
    assert value(s, "tidepool_tasks_created_total", type="scan") == 3
    assert value(s, "tidepool_tasks_finished_total", type="noop", state="completed") == 1
    assert value(s, "tidepool_tasks_finished_total", type="scan", state="timed_out") == 1
    assert value(s, "tidepool_tasks_finished_total", type="scan", state="failed") == 1
    assert value(s, "tidepool_task_retries_total", type="scan") == 1
    assert value(s, "tidepool_task_duration_seconds_count", type="noop") == 1
    assert value(s, "tidepool_task_duration_seconds_sum", type="noop") == pytest.approx(0.202)
    assert value(s, "tidepool_task_duration_seconds_count", type="scan") == 4  # two attempts, a failure, a loss
    assert value(s, "tidepool_phase_duration_seconds_bucket", phase="run", le="0.25") == 1  # ok's 0.2 s run
    assert value(s, "tidepool_phase_duration_seconds_bucket", phase="run", le="5.0") == 5
    assert value(s, "tidepool_phase_duration_seconds_count", phase="stop") == 5
    assert value(s, "tidepool_pickup_latency_seconds_bucket", type="noop", le="0.0025") == 0
    assert value(s, "tidepool_pickup_latency_seconds_bucket", type="noop", le="0.005") == 1
    assert value(s, "tidepool_plugin_duration_seconds_count", plugin="noop") == 1
    assert value(s, "tidepool_plugin_kills_total", reason="timeout") == 2
    assert value(s, "tidepool_plugin_kills_total", reason="memory_mb") == 1
    assert value(s, "tidepool_plugin_kills_total", reason="lease_lost") == 1
    assert value(s, "tidepool_lease_losses_total") == 1


async def test_a_cancel_before_the_run_phase_kills_no_plugin() -> None:
    metrics, bus, clock = make_metrics()
    task_id = new_id()
    cancelled = {"code": "cancelled", "message": "cancelled on request"}
    run_attempt(bus, clock, task_id, phases=[("initialize", 0), ("prepare", 0), ("stop", 2.0)],
                end=("task.finished", {"state": "cancelled", "error": cancelled, "type": "scan"}))
    other = new_id()
    run_attempt(bus, clock, other, phases=[("initialize", 0), ("prepare", 0), ("run", 0), ("stop", 2.0)],
                end=("task.finished", {"state": "cancelled", "error": cancelled, "type": "scan"}))
    # An ending whose event names no type (every publisher names it now): the fallback label.
    bus.publish("task.finished", task_id=new_id(), worker_id=None, state="cancelled", error=None)
    s = await scrape(metrics)
    assert value(s, "tidepool_plugin_kills_total", reason="cancel") == 1
    assert value(s, "tidepool_tasks_finished_total", type="scan", state="cancelled") == 2
    assert value(s, "tidepool_tasks_finished_total", type="unknown", state="cancelled") == 1
    assert value(s, "tidepool_phase_duration_seconds_count", phase="prepare") == 2


async def test_gauges_are_read_at_scrape_time() -> None:
    stats = [pool_stats()]
    guards = GuardStats(("disk",), 256, 512, free_memory_mb=4096, free_disk_mb=100)
    metrics = Metrics(node_id="node-a", version="9.9", pool=lambda: stats[0], counts=counts,
                      guards=lambda: guards, draining=lambda: True)
    s = await scrape(metrics)
    assert value(s, "tidepool_info", node_id="node-a", version="9.9") == 1
    assert value(s, "tidepool_workers", kind="baseline") == 2
    assert value(s, "tidepool_workers", kind="demand") == 3
    assert value(s, "tidepool_workers_busy") == 3
    assert value(s, "tidepool_pool_max_workers") == 8
    assert value(s, "tidepool_draining") == 1
    assert value(s, "tidepool_store_up") == 1
    assert value(s, "tidepool_queue_depth", state="pending") == 12
    assert value(s, "tidepool_queue_depth", state="retry_wait") == 0
    assert value(s, "tidepool_guard_tripped", guard="disk") == 1
    assert value(s, "tidepool_guard_tripped", guard="memory") == 0
    assert value(s, "tidepool_guard_free_bytes", guard="disk") == 100 * 2**20
    assert value(s, "process_resident_memory_bytes") is not None  # the standard process collector too

    stats[0] = pool_stats(workers=16, baseline=16, demand=0, busy=16, max_workers=16)
    s = await scrape(metrics)
    assert value(s, "tidepool_workers_busy") == 16
    assert value(s, "tidepool_pool_max_workers") == 16


async def test_store_down_shows_as_store_up_0_and_no_queue() -> None:
    async def down() -> dict[State, int]:
        raise StoreUnavailable("database is locked")

    metrics = Metrics(node_id="n", version="v", pool=lambda: pool_stats(), counts=down)
    s = await scrape(metrics)
    assert value(s, "tidepool_store_up") == 0
    assert not any(name == "tidepool_queue_depth" for name, _ in s)
    assert value(s, "tidepool_workers_busy") == 3


async def test_a_fresh_node_exports_every_known_series_at_zero() -> None:
    """Before anything happened: a series that appeared only with its first increment would hide that
    increment from rate(). The task types are read at each scrape: a reload's new type is there too."""
    types = ["noop", "scan"]
    metrics, _, _ = make_metrics(task_types=lambda: types)
    s = await scrape(metrics)
    zeros = [("tidepool_tasks_created_total", {"type": t}) for t in types]
    zeros += [("tidepool_tasks_finished_total", {"type": t, "state": state}) for t in types
              for state in ("completed", "failed", "timed_out", "cancelled")]
    zeros += [("tidepool_task_retries_total", {"type": t}) for t in types]
    zeros += [("tidepool_task_duration_seconds_count", {"type": t}) for t in types]
    zeros += [("tidepool_pickup_latency_seconds_bucket", {"type": t, "le": "+Inf"}) for t in types]
    zeros += [("tidepool_phase_duration_seconds_count", {"phase": p}) for p in ("initialize", "prepare", "run", "stop")]
    zeros += [("tidepool_reconciler_actions_total", {"action": a})
              for a in ("expired", "promoted", "cancelled", "pruned", "unserviceable")]
    zeros += [(name, {}) for name in ("tidepool_reconciler_passes_total", "tidepool_lease_renewals_total",
                                      "tidepool_lease_renewal_errors_total", "tidepool_lease_losses_total")]
    zeros += [("tidepool_plugin_kills_total", {"reason": r}) for r in ("timeout", "cancel", "memory_mb", "lease_lost")]
    zeros += [("tidepool_workers_started_total", {"kind": k}) for k in ("baseline", "demand")]
    zeros += [("tidepool_workers_stopped_total", {"kind": "demand", "reason": "idle"})]
    zeros += [("tidepool_config_reloads_total", {"result": r}) for r in ("ok", "rejected")]
    assert [(name, labels) for name, labels in zeros if value(s, name, **labels) != 0] == []

    types.append("quick")  # a reload defined it
    assert value(await scrape(metrics), "tidepool_tasks_finished_total", type="quick", state="failed") == 0


async def test_reconciler_workers_guards_and_reloads() -> None:
    metrics, bus, _ = make_metrics()
    for _ in range(2):
        bus.publish("task.expired", task_id=new_id(), worker_id=None, attempt_id="a", state="retry_wait")
    bus.publish("reconciler.pass", expired=2, promoted=3, cancelled=0, pruned=7, unserviceable=4)
    bus.publish("worker.started", worker_id="w1", kind="baseline")
    bus.publish("worker.started", worker_id="w2", kind="demand")
    bus.publish("worker.stopped", worker_id="w2", kind="demand", reason="idle")
    bus.publish("guard.tripped", guard="memory", free_mb=10, min_free_mb=256)
    metrics.reloaded(ok=True)
    metrics.reloaded(ok=False)
    metrics.reloaded(ok=False)
    s = await scrape(metrics)
    assert value(s, "tidepool_reconciler_actions_total", action="expired") == 2
    assert value(s, "tidepool_reconciler_actions_total", action="promoted") == 3
    assert value(s, "tidepool_reconciler_actions_total", action="pruned") == 7
    assert value(s, "tidepool_reconciler_actions_total", action="unserviceable") == 4
    assert value(s, "tidepool_reconciler_actions_total", action="cancelled") == 0  # a pass's 0 adds nothing
    assert value(s, "tidepool_workers_started_total", kind="demand") == 1
    assert value(s, "tidepool_workers_stopped_total", kind="demand", reason="idle") == 1
    assert value(s, "tidepool_guard_tripped", guard="memory") == 1  # no guards object: from the events
    assert value(s, "tidepool_config_reloads_total", result="rejected") == 2
    bus.publish("guard.cleared", guard="memory", free_mb=900, min_free_mb=256)
    assert value(await scrape(metrics), "tidepool_guard_tripped", guard="memory") == 0


class FakeStore:
    def __init__(self) -> None:
        self.fail = False

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, Exception]:
        if self.fail:
            raise StoreUnavailable("down")
        return {leases[0].attempt_id: Exception("lost")}

    async def counts(self) -> dict[State, int]:
        return {}


async def test_renewals_are_counted_where_the_lease_keeper_writes_them() -> None:
    metrics, _, _ = make_metrics()
    fake = FakeStore()
    store = metrics.lease_store(fake)  # type: ignore[arg-type]
    leases = [Lease(new_id(), new_id(), "t", 0.0) for _ in range(3)]
    lost = await store.renew(leases, now=0.0, lease_s=30.0)
    assert list(lost) == [leases[0].attempt_id]
    fake.fail = True
    with pytest.raises(StoreUnavailable):
        await store.renew(leases, now=0.0, lease_s=30.0)
    assert await store.counts() == {}  # everything else passes through
    s = await scrape(metrics)
    assert value(s, "tidepool_lease_renewals_total") == 2
    assert value(s, "tidepool_lease_renewal_errors_total") == 1


def test_a_malformed_event_is_logged_once_and_never_raised_to_the_publisher(
        caplog: pytest.LogCaptureFixture) -> None:
    _, bus, _ = make_metrics()
    with caplog.at_level(logging.ERROR, logger="tidepool.metrics"):
        for _ in range(3):
            bus.publish("task.phase", worker_id="w1")  # no task_id, no phase
            bus.publish("guard.tripped")
    assert len(caplog.records) == 2


def test_each_metrics_object_has_its_own_registry() -> None:
    first, _, _ = make_metrics()
    second, _, _ = make_metrics()
    assert first.registry is not second.registry


async def test_schedule_ticks_are_counted_per_schedule() -> None:
    metrics, bus, _ = make_metrics()
    bus.publish("schedule.fired", task_id="t1", worker_id=None, schedule="nightly", tick="2026-11-30T02:00:00Z")
    bus.publish("schedule.fired", task_id="t2", worker_id=None, schedule="nightly", tick="2026-12-01T02:00:00Z")
    bus.publish("schedule.skipped", task_id=None, worker_id=None, schedule="hourly", tick="x", reason="missed", count=3)
    samples = await scrape(metrics)
    assert value(samples, "tidepool_schedule_fired_total", schedule="nightly") == 2
    assert value(samples, "tidepool_schedule_skipped_total", schedule="hourly", reason="missed") == 3


async def test_unfinished_tasks_are_counted_by_organization_at_scrape_time() -> None:
    """One gauge: an organization label on the per-type counters would multiply their series by the
    organizations of the fleet."""
    seen = [{"default": 3, "acme": 1}]

    async def organizations() -> dict[str, int]:
        return seen[0]

    metrics = Metrics(node_id="n", version="v", pool=lambda: pool_stats(), counts=counts, organizations=organizations)
    s = await scrape(metrics)
    assert value(s, "tidepool_tasks_by_organization", organization="default") == 3
    assert value(s, "tidepool_tasks_by_organization", organization="acme") == 1
    seen[0] = {"default": 1}
    s = await scrape(metrics)
    assert value(s, "tidepool_tasks_by_organization", organization="acme") is None
    assert value(s, "tidepool_tasks_by_organization", organization="default") == 1
