"""The in-process event bus: one bounded ring of recent events that every subscriber reads at its own pace.

Publishing costs the same with or without subscribers: the event goes into the ring, synchronous
listeners (metrics, logs) see it, and subscribers that sleep are woken. Each subscriber keeps only
its position in the ring and filters on its own time, so a slow one never slows the pool; one that
falls a whole ring behind is dropped. The ring also serves Last-Event-ID resumption.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

RING_SIZE = 10_000


@dataclass(slots=True)  # built for every step of every task: plain is cheaper than frozen
class Event:
    id: int
    name: str
    ts: float
    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "event": self.name, "ts": self.ts, **self.data}


class Subscription:
    """A reader's position in the bus's ring and its filter."""

    def __init__(self, bus: EventBus, accept: Callable[[Event], bool] | None, next_id: int) -> None:
        self._bus = bus
        self.accept = accept
        self.next_id = next_id
        self.dropped = False  # fell a whole ring behind
        self.closed = False   # the bus shut down
        self._wake = asyncio.Event()

    async def next_batch(self, *, max_events: int = 512, timeout_s: float = 15.0,
                         linger_s: float = 0.0) -> list[Event] | None:
        """The accepted events after the last batch, waiting up to timeout_s for one ([] if none came);
        None once this subscription is over (see `dropped`). Once woken it lingers `linger_s` so that
        what follows rides along: a busy pool then costs each subscriber a few writes a second."""
        # asyncio's own timer and sleep, not anyio's scopes: this runs per subscriber per write, and the
        # scopes were half of what 20 subscribers cost the event loop (measured with py-spy).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self.closed or self.next_id < self._bus.oldest_id():
                self.dropped = not self.closed
                return None
            batch = self._read(max_events)
            if batch:
                return batch
            if loop.time() >= deadline:
                return []
            if self.next_id >= self._bus.next_id:
                self._wake.clear()
                self._bus.sleeping.add(self)
                timer = loop.call_at(deadline, self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    timer.cancel()
                if linger_s:
                    await asyncio.sleep(linger_s)

    def _read(self, max_events: int) -> list[Event]:
        if self.accept is None:  # everything: a slice of the ring, no Python step per event
            end = min(self._bus.next_id, self.next_id + max_events)
            batch = self._bus.between(self.next_id, end)
            self.next_id = end
            return batch
        batch = []
        end = min(self._bus.next_id, self.next_id + max_events * 4)  # bounded work per call
        while self.next_id < end and len(batch) < max_events:
            event = self._bus.get(self.next_id)
            self.next_id += 1
            if event is not None and self.accept(event):
                batch.append(event)
        return batch

    def wake(self) -> None:
        self._wake.set()


class EventBus:
    def __init__(self, *, ring_size: int = RING_SIZE, clock: Callable[[], float] = time.time) -> None:
        self._ring: list[Event | None] = [None] * ring_size
        # Each event's encoded form (the SSE frame), beside it: subscribers reading the same events share
        # one encoding, and a contiguous run of them is one slice, with no Python step per event.
        self._encoded: list[bytes | None] = [None] * ring_size
        self.next_id = 1
        self.sleeping: set[Subscription] = set()
        self._subscribers: set[Subscription] = set()
        self._clock = clock
        self._listeners: list[Callable[[Event], None]] = []

    def publish(self, name: str, **data: Any) -> Event:
        event = Event(self.next_id, name, self._clock(), data)
        slot = event.id % len(self._ring)
        self._ring[slot] = event
        self._encoded[slot] = None
        self.next_id += 1
        for listener in self._listeners:
            listener(event)
        if self.sleeping:
            for sub in self.sleeping:
                sub.wake()
            self.sleeping.clear()
        return event

    def listen(self, listener: Callable[[Event], None]) -> None:
        """A synchronous in-process listener (metrics, logs); must be cheap and must not block."""
        self._listeners.append(listener)

    def subscribe(self, *, accept: Callable[[Event], bool] | None = None, after: int | None = None) -> Subscription:
        """Read future events, or with `after` every event the ring still holds past that id; `accept`
        filters them (None: every event)."""
        start = self.next_id if after is None else max(after + 1, self.oldest_id())
        sub = Subscription(self, accept, start)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)
        self.sleeping.discard(sub)

    def get(self, event_id: int) -> Event | None:
        event = self._ring[event_id % len(self._ring)]
        return event if event is not None and event.id == event_id else None

    def between(self, first: int, end: int) -> list[Event]:
        """The events with ids first .. end - 1, all of which the ring must still hold."""
        size = len(self._ring)
        if end <= first:
            return []
        i, j = first % size, end % size
        events = self._ring[i:j] if i < j else self._ring[i:] + self._ring[:j]
        return events  # type: ignore[return-value]  # every slot in [oldest_id, next_id) is filled

    def encoded(self, first: int, end: int, encode: Callable[[Event], bytes]) -> list[bytes]:
        """The encoded forms of the events with ids first .. end - 1 (all still in the ring), each made
        by `encode` the first time it is asked for and kept until its slot is reused."""
        if end <= first:
            return []
        size = len(self._ring)
        i, j = first % size, end % size
        forms = self._encoded[i:j] if i < j else self._encoded[i:] + self._encoded[:j]
        if None in forms:  # C speed: usually every form exists already
            for k, form in enumerate(forms):
                if form is None:
                    slot = (first + k) % size
                    forms[k] = self._encoded[slot] = encode(self._ring[slot])  # type: ignore[arg-type]
        return forms  # type: ignore[return-value]  # every None was filled

    def oldest_id(self) -> int:
        """The id of the oldest event the ring still holds (the next id when it is empty)."""
        return max(1, self.next_id - len(self._ring))

    def since(self, after: int) -> Iterator[Event]:
        for event_id in range(max(after + 1, self.oldest_id()), self.next_id):
            event = self.get(event_id)
            if event is not None:
                yield event

    def close(self) -> None:
        """Shutdown: every subscription ends with its final event."""
        for sub in list(self._subscribers):
            sub.closed = True
            sub.wake()
        self._subscribers.clear()
        self.sleeping.clear()
