"""The series /metrics exports, kept as plain dicts and lists (the event listener feeds them for every step
of every task, always on the event loop's thread: no lock, no label lookup) and turned into
prometheus_client's metric families when scraped."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

Labels = tuple[str, ...]
UNKNOWN = "unknown"  # a label an event did not carry (every task event names its type; this is the fallback)


class Counter:
    """A counter family. Every label set it knows is exported from the start, at zero: a series that
    appears only with its first increment hides that increment from rate() and increase()."""

    __slots__ = ("doc", "labels", "name", "values")

    def __init__(self, name: str, doc: str, *labels: str, known: Iterable[Labels] = ()) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.values: dict[Labels, float] = {}
        self.know(known if labels else [()])

    def know(self, keys: Iterable[Labels]) -> None:
        for key in keys:
            self.values.setdefault(key, 0.0)

    def inc(self, key: Labels, amount: float = 1) -> None:
        self.values[key] = self.values.get(key, 0) + amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, value in self.values.items():
            family.add_metric(list(key), value)
        return family


class Histogram:
    """A histogram family with one label; observing is a dict lookup, a bisect and two list updates. Its
    known label values are exported from the start with empty buckets, as a counter's are at zero."""

    __slots__ = ("bounds", "doc", "label", "name", "series")

    def __init__(self, name: str, doc: str, bounds: Sequence[float], label: str, *, known: Iterable[str] = ()) -> None:
        self.name, self.doc, self.label = name, doc, label
        self.bounds = tuple(bounds)
        self.series: dict[str, list[float]] = {}  # per bucket (le), then +Inf, then the sum
        self.know(known)

    def know(self, labels: Iterable[str]) -> None:
        for label in labels:
            if label not in self.series:
                self._add(label)

    def observe(self, label: str, value: float) -> None:
        series = self.series.get(label) or self._add(label)
        if value < 0.0:  # event clocks are wall clocks: a step back must not go negative
            value = 0.0
        series[bisect.bisect_left(self.bounds, value)] += 1
        series[-1] += value

    def _add(self, label: str) -> list[float]:
        series = self.series[label] = [0.0] * (len(self.bounds) + 2)
        return series

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=[self.label])
        for label, series in self.series.items():
            cumulative, buckets = 0.0, []
            for bound, count in zip((*self.bounds, math.inf), series, strict=False):
                cumulative += count
                buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
            family.add_metric([label], buckets, sum_value=series[-1])
        return family


def gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), float(value))
    return family
