"""The in-process event bus: a bounded ring for resumption and bounded queues per subscriber."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)  # built for every step of every task: plain is cheaper than frozen
class Event:
    id: int
    name: str
    ts: float
    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "event": self.name, "ts": self.ts, **self.data}


class Subscription:
    """One listener's bounded queue; a listener that falls behind is dropped, never waited for."""

    def __init__(self, bus: EventBus, maxsize: int, accept: Callable[[Event], bool]) -> None:
        self._bus = bus
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue(maxsize)
        self.accept = accept
        self.dropped = False

    def offer(self, event: Event) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped = True
            self._bus.unsubscribe(self)

    def close(self) -> None:
        try:
            self._queue.put_nowait(None)
        except asyncio.QueueFull:
            self.dropped = True

    async def get(self) -> Event | None:
        """The next event; None when the bus closed this subscription."""
        if self.dropped and self._queue.empty():
            return None
        return await self._queue.get()


class EventBus:
    def __init__(self, *, ring_size: int = 10_000, clock: Callable[[], float] = time.time) -> None:
        self._ring: collections.deque[Event] = collections.deque(maxlen=ring_size)
        self._subscribers: list[Subscription] = []
        self._next_id = 1
        self._clock = clock
        self._listeners: list[Callable[[Event], None]] = []

    def publish(self, name: str, **data: Any) -> Event:
        event = Event(self._next_id, name, self._clock(), data)
        self._next_id += 1
        self._ring.append(event)
        for listener in self._listeners:
            listener(event)
        for sub in self._subscribers:
            if sub.accept(event):
                sub.offer(event)
        return event

    def listen(self, listener: Callable[[Event], None]) -> None:
        """A synchronous in-process listener (metrics, notify status); must not block."""
        self._listeners.append(listener)

    def subscribe(self, *, maxsize: int = 1000, accept: Callable[[Event], bool] = lambda e: True,
                  after: int | None = None) -> Subscription:
        """A bounded queue of future events, first replaying the ring after event id `after`."""
        sub = Subscription(self, maxsize, accept)
        if after is not None:
            for event in self.since(after):
                if accept(event):
                    sub.offer(event)
        self._subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subscribers:
            self._subscribers.remove(sub)

    def oldest_id(self) -> int:
        """The id of the oldest event the ring still holds (the next id when it is empty)."""
        return self._ring[0].id if self._ring else self._next_id

    def since(self, after: int) -> Iterator[Event]:
        return (e for e in self._ring if e.id > after)

    def close(self) -> None:
        for sub in list(self._subscribers):
            sub.close()
        self._subscribers.clear()
