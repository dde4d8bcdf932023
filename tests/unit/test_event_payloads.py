"""A task's own events cost no payload nobody reads: their data is built only when read, counted by Shape.builds."""

from __future__ import annotations

import logging

import pytest

from tidepool import logs
from tidepool.events import SHAPES, TASK_FINISHED, TASK_PHASE, EventBus, Filter
from tidepool.execution.pool import PoolStats
from tidepool.metrics.exporter import Metrics
from tidepool.model import State


def builds() -> int:
    return sum(shape.builds for shape in SHAPES.values())


async def counts() -> dict[State, int]:
    return {}


def a_task(bus: EventBus, task_id: str = "t1") -> None:
    """What the pool and engine publish for a no-op task."""
    bus.publish("task.leased", task_id, "w1", "a1", 1, "noop", 0.0)
    for phase in ("initialize", "prepare", "run"):
        bus.publish("task.phase", task_id, "w1", phase, "a1")
    bus.publish("plugin.started", task_id, "w1", "noop")
    bus.publish("plugin.finished", task_id, "w1", "noop", 0.001, "succeeded")
    bus.publish("task.phase", task_id, "w1", "stop", "a1")
    bus.publish("task.finished", task_id, "w1", "completed", None, "noop")


def test_an_event_no_listener_takes_builds_no_payload_until_it_is_read() -> None:
    bus = EventBus()
    before = builds()
    a_task(bus)
    assert builds() == before, "kept in the ring, not built"
    replay = bus.since(0)  # a stream resuming from the ring reads them: built then, once each
    assert [e.data for e in replay][-1] == {"task_id": "t1", "worker_id": "w1", "state": "completed",
                                             "error": None, "type": "noop"}
    assert replay[1].data == {"task_id": "t1", "worker_id": "w1", "phase": "initialize", "attempt_id": "a1"}
    assert builds() == before + 8
    assert [e.data for e in bus.since(0)] == [e.data for e in replay] and builds() == before + 8


def test_metrics_and_info_logs_count_a_task_without_building_its_events(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    metrics = Metrics(node_id="n", version="v", pool=lambda: PoolStats(1, 1, 1.0, 1, 0, 1, 0, True), counts=counts)
    metrics.attach(bus)
    logs.attach(bus)
    before = builds()
    with caplog.at_level(logging.INFO, logger="tidepool"):
        a_task(bus)
    assert builds() == before
    assert metrics.finished.values[("noop", "completed")] == 1
    assert sum(metrics.task_duration.series["noop"][:-1]) == 1  # one attempt timed, initialize to end
    with caplog.at_level(logging.DEBUG, logger="tidepool"):  # a listener that wants them builds them
        a_task(bus, "t2")
    assert builds() == before + 7  # the logged steps: lease, four phases, the plugin start and finish
    assert any(r.getMessage().startswith("task t2 plugin noop finished") for r in caplog.records)


def test_a_filtered_subscriber_is_handed_its_task_s_events_without_building_the_others() -> None:
    bus = EventBus()
    sub = bus.subscribe(Filter(task_id="mine"))
    before = TASK_PHASE.builds
    a_task(bus, "other")
    a_task(bus, "mine")
    assert TASK_PHASE.builds == before
    assert [e.data["phase"] for e in sub._handed if e.name == "task.phase"] == ["initialize", "prepare", "run",
                                                                                "stop"]


def test_an_event_with_a_shape_published_with_keywords_is_counted_the_same() -> None:
    bus = EventBus()
    metrics = Metrics(node_id="n", version="v", pool=lambda: PoolStats(1, 1, 1.0, 1, 0, 1, 0, True), counts=counts)
    metrics.attach(bus)
    bus.publish("task.finished", task_id="t9", worker_id=None, state="cancelled", error=None, type="scan")
    assert metrics.finished.values[("scan", "cancelled")] == 1
    assert TASK_FINISHED.fields == ("task_id", "worker_id", "state", "error", "type")
