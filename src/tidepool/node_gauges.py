"""The gauges a scrape reads from this node's live parts: its pool's workers and the host guards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from .metric_series import gauge

if TYPE_CHECKING:
    from .guards import GuardStats
    from .pool import PoolStats

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
