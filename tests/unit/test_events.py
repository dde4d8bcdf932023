"""The event bus's ring as subscribers read it, and the frames of what they read, each encoded once."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import tidepool
from tidepool.api.stream.frames import frame, frames
from tidepool.events import EVENT_NAMES, Event, EventBus, Filter, first_id_of_this_run


def publish(bus: EventBus, n: int) -> None:
    for i in range(n):
        bus.publish("task.phase", task_id=f"t{i % 3}", phase="run")


async def test_a_filtered_subscriber_gets_only_what_it_accepts() -> None:
    bus = EventBus(ring_size=64)
    sub = bus.subscribe(where=Filter(task_id="t1"))
    publish(bus, 9)
    batch = await sub.next_batch(timeout_s=0)
    assert batch is not None
    assert [e.id for e in batch] == [2, 5, 8]


async def test_a_filtered_subscriber_resumes_from_the_ring_then_is_handed_only_what_it_accepts() -> None:
    bus = EventBus(ring_size=64)
    publish(bus, 6)  # ids 1..6: task.phase for t0, t1, t2, t0, t1, t2
    bus.publish("task.finished", task_id="t1", state="completed")  # id 7
    sub = bus.subscribe(where=Filter(task_id="t1", names=("task.*",)), after=2)
    backlog = await sub.next_batch(timeout_s=0)
    assert backlog is not None and [e.id for e in backlog] == [5, 7]
    waiting = asyncio.create_task(sub.next_batch(timeout_s=5))
    await asyncio.sleep(0)  # it waits now
    bus.publish("plugin.started", task_id="t1", plugin="noop")  # its task, not its names
    bus.publish("task.phase", task_id="t2", phase="run")        # its names, not its task
    bus.publish("task.phase", task_id="t1", phase="stop")       # id 10
    batch = await asyncio.wait_for(waiting, 1)
    assert batch is not None and [e.id for e in batch] == [10]


async def test_a_filtered_subscriber_sleeps_through_other_tasks_events() -> None:
    bus = EventBus(ring_size=64)
    sub = bus.subscribe(where=Filter(task_id="mine"))
    names_only = bus.subscribe(where=Filter(names=("task.finished",)))
    waiting = asyncio.create_task(sub.next_batch(timeout_s=30))
    await asyncio.sleep(0)  # it waits now
    for _ in range(5):
        publish(bus, 10)
        assert not sub._wake.is_set()  # other tasks' events do not wake it
        await asyncio.sleep(0)
    assert not waiting.done()
    mine = bus.publish("task.phase", task_id="mine", phase="run")
    batch = await asyncio.wait_for(waiting, 5)
    assert batch == [mine]
    bus.unsubscribe(sub)
    bus.publish("task.phase", task_id="mine", phase="run")  # after unsubscribe: handed to no one
    bus.publish("task.finished", task_id="other", state="completed")
    assert sub._handed == []
    batch = await names_only.next_batch(timeout_s=0)
    assert batch is not None and [e.name for e in batch] == ["task.finished"]


async def test_a_filtered_subscriber_a_ring_behind_is_dropped_and_holds_nothing() -> None:
    bus = EventBus(ring_size=8)
    lagging = bus.subscribe(where=Filter(task_id="t0"))
    keeping_up = bus.subscribe(where=Filter(task_id="t1"))
    publish(bus, 6)  # t0, t1, t2, t0, t1, t2: all still in the ring
    batch = await keeping_up.next_batch(timeout_s=0)
    assert batch is not None and [e.id for e in batch] == [2, 5]
    assert frames(bus, batch) == frame(batch[0]) + frame(batch[1])
    publish(bus, 6)  # ids 7..12: the ring holds 5..12, so t0's unread event 1 is gone
    assert lagging.dropped and lagging._handed == []  # noticed at publish: nothing kept past the ring
    assert await lagging.next_batch(timeout_s=0) is None
    batch = await keeping_up.next_batch(timeout_s=0)
    assert batch is not None and [e.id for e in batch] == [8, 11]


async def test_a_waiting_subscriber_is_woken_by_a_publish_and_lingers_for_what_follows() -> None:
    bus = EventBus(ring_size=64)
    sub = bus.subscribe(Filter(names=("task.*",)))
    waiting = asyncio.create_task(sub.next_batch(timeout_s=5, linger_s=0.5))  # ample for a busy machine
    await asyncio.sleep(0.01)
    assert not waiting.done()
    publish(bus, 1)
    await asyncio.sleep(0.01)
    publish(bus, 2)  # within the linger: rides along in the same batch
    batch = await asyncio.wait_for(waiting, 1)
    assert batch is not None and [e.id for e in batch] == [1, 2, 3]


async def test_a_subscriber_with_nothing_to_read_gets_an_empty_batch_at_its_timeout() -> None:
    bus = EventBus(ring_size=64)
    sub = bus.subscribe(Filter(names=("task.*",)))
    started = time.monotonic()
    assert await sub.next_batch(timeout_s=0.1, linger_s=5) == []  # the deadline ends it: no linger after
    assert 0.09 <= time.monotonic() - started < 5
    publish(bus, 1)  # still subscribed: the next read gets it
    batch = await sub.next_batch(timeout_s=0.1)
    assert batch is not None and [e.id for e in batch] == [1]


async def test_at_shutdown_subscribers_first_read_what_was_published_before() -> None:
    bus = EventBus(ring_size=64)
    subs = [bus.subscribe(Filter(names=("task.*",))), bus.subscribe(Filter(task_id="t0"))]
    waiting = [asyncio.create_task(sub.next_batch(timeout_s=10, linger_s=0.05)) for sub in subs]
    await asyncio.sleep(0.01)
    publish(bus, 3)  # for t0, t1 and t2: woken, the subscribers linger
    bus.close()
    batches = [await asyncio.wait_for(w, 1) for w in waiting]
    assert [[e.id for e in b or []] for b in batches] == [[1, 2, 3], [1]]
    assert [await sub.next_batch(timeout_s=10) for sub in subs] == [None, None]


def test_a_write_holds_the_frames_of_its_events_encoded_once_even_across_the_rings_wrap() -> None:
    bus = EventBus(ring_size=8)
    publish(bus, 5)
    encoded: list[int] = []

    def counting(event: Event) -> bytes:
        encoded.append(event.id)
        return frame(event)

    for _ in range(3):  # 5 + 3 x 4 events through a ring of 8: the later runs cross its end
        publish(bus, 4)
        run = bus.between(bus.next_id - 6, bus.next_id)
        expected = b"".join(frame(e) for e in run)
        assert b"".join(bus.encoded(run[0].id, run[-1].id + 1, counting)) == expected
        assert b"".join(bus.encoded(run[0].id, run[-1].id + 1, counting)) == expected  # a second reader
        assert frames(bus, run) == expected
        gaps = [run[0], run[3], run[-1]]  # what a filter might pass
        assert frames(bus, gaps) == b"".join(frame(e) for e in gaps)
    assert sorted(encoded) == list(range(4, 18))  # each event encoded once, while the ring held it


def test_a_run_numbers_its_events_from_its_first_id_and_resumes_only_from_its_own() -> None:
    first = first_id_of_this_run()
    assert first_id_of_this_run() >= first > 1_700_000_000_000_000  # microseconds: later runs start higher
    bus = EventBus(ring_size=4, first_id=first)
    assert bus.oldest_id() == first and bus.since(first - 1) == []
    publish(bus, 3)
    assert [e.id for e in bus.since(first - 1)] == [first, first + 1, first + 2]
    publish(bus, 3)  # six through a ring of four: the first two are gone
    assert bus.oldest_id() == first + 2
    assert [e.id for e in bus.since(first)] == [first + 2, first + 3, first + 4, first + 5]


async def test_a_subscriber_arriving_after_shutdown_is_ended_at_once() -> None:
    bus = EventBus(ring_size=8)
    bus.close()
    for where in (Filter(task_id="t0"), Filter(names=("task.*",))):
        sub = bus.subscribe(where)
        assert await asyncio.wait_for(sub.next_batch(timeout_s=5), 1) is None
        assert sub.closed and not sub.dropped


def test_the_list_of_event_names_is_every_name_published() -> None:
    """The `type` filter of GET /v1/events refuses names outside EVENT_NAMES: it must not miss one."""
    source = Path(tidepool.__file__).parent
    published = {name for path in source.rglob("*.py")
                 for name in re.findall(r'\.publish\(\s*"([a-z_.]+)"', path.read_text())}
    assert published == EVENT_NAMES
