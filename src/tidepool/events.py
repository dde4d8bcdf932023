"""The in-process event bus: one bounded ring of recent events, read at each reader's own pace.

Publishing costs the same with or without unfiltered readers: the event goes into the ring,
synchronous listeners (metrics, logs) see it, and a reader waiting for events (the API's fan-out,
which serves every unfiltered stream) is woken. That reader keeps one position in the ring per
stream, so a slow stream never slows the pool; one whose next event has left the ring is dropped.
A filtered Subscription (one task, or some event names: a CLI waiting for its task) is handed just
the events it accepts, found by the task id and name at publish time, never by scanning every
event; it too is dropped once its oldest unread event has left the ring. The ring also serves
Last-Event-ID resumption, and keeps each event's encoded frame beside it.

What each task publishes (its lease, phases, plugins, end) has a Shape and is published with bare
arguments, `publish("task.phase", task_id, ...)`: the ring keeps them, and the event's data (a dict)
is built only when something reads it (a stream, a resume, a listener of that name). Tallies (the
metrics) count such an event from its arguments, so a pool that nobody streams builds no payload at
all. Every other event is published with its data as keywords, `publish(name, **data)`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Protocol, TypeAlias, TypeVar

log = logging.getLogger("tidepool.events")
RING_SIZE = 10_000
# Every name published (those the events reference lists, and task.lease_lost); a test holds it to the publish calls.
# A stream's `type` filter that matches none of them is a typo, refused rather than streamed as silence.
EVENT_NAMES = frozenset({
    "task.created", "task.leased", "task.phase", "plugin.started", "plugin.finished", "task.progress",
    "task.result", "task.retry_scheduled", "task.expired", "task.cancel_requested", "task.finished",
    "task.lease_lost", "worker.started", "worker.stopped", "pool.resized", "guard.tripped", "guard.cleared",
    "schedule.fired", "schedule.skipped", "reconciler.pass", "scan.created", "scan.step", "scan.finished",
    "worker.enrolled", "worker.state",
})
T = TypeVar("T")
Listener: TypeAlias = "Callable[[Event], None]"
Tally: TypeAlias = "Callable[..., None]"  # (ts, *the shape's fields)


class Shape:
    """An event published for every task, with its fields in order: published as bare arguments, its data
    dict built only on demand (`builds` counts how often, for the tests)."""

    def __init__(self, name: str, *fields: str) -> None:
        self.name = name
        self.fields = fields
        self.builds = 0
        SHAPES[name] = self

    def payload(self, args: tuple[Any, ...]) -> dict[str, Any]:
        self.builds += 1
        return dict(zip(self.fields, args, strict=True))

    def args_of(self, data: dict[str, Any]) -> tuple[Any, ...]:
        """A published event's data as this shape's arguments (a tally's view of it)."""
        return tuple([data.get(f) for f in self.fields])


SHAPES: dict[str, Shape] = {}
TASK_LEASED = Shape("task.leased", "task_id", "worker_id", "attempt_id", "attempt", "type", "available_at")
TASK_PHASE = Shape("task.phase", "task_id", "worker_id", "phase", "attempt_id")
PLUGIN_STARTED = Shape("plugin.started", "task_id", "worker_id", "plugin")
PLUGIN_FINISHED = Shape("plugin.finished", "task_id", "worker_id", "plugin", "duration_s", "outcome")
TASK_FINISHED = Shape("task.finished", "task_id", "worker_id", "state", "error", "type")


class Sleeper(Protocol):
    """A reader waiting for the next event: woken once, when one is published."""

    def wake(self) -> None: ...


class Event:
    """One event of the bus. An emitted one holds its shape's arguments until its data is first read."""

    __slots__ = ("_args", "_data", "_shape", "id", "name", "ts")  # built for every step of every task

    def __init__(self, id: int, name: str, ts: float, data: dict[str, Any] | None = None,
                 shape: Shape | None = None, args: tuple[Any, ...] = ()) -> None:
        self.id, self.name, self.ts = id, name, ts
        self._data, self._shape, self._args = data, shape, args

    @property
    def data(self) -> dict[str, Any]:
        if self._data is None:
            self._data = self._shape.payload(self._args) if self._shape is not None else {}
        return self._data

    @property
    def task_id(self) -> Any:
        """The task it is about (None: none), without building the data of an emitted event."""
        if self._data is None and self._shape is not None:
            return self._args[0]  # every shape's first field
        return self.data.get("task_id")

    def __repr__(self) -> str:
        return f"Event({self.id}, {self.name!r}, {self.ts}, {self.data!r})"


@dataclass(frozen=True)
class Filter:
    """Which events a subscriber wants: those of one task, and/or those whose name matches a glob."""

    task_id: str | None = None
    names: tuple[str, ...] = ()

    def accepts_name(self, name: str) -> bool:
        return not self.names or any(fnmatchcase(name, glob) for glob in self.names)

    def accepts(self, event: Event) -> bool:
        return (self.task_id is None or event.task_id == self.task_id) and self.accepts_name(event.name)


class Subscription:
    """A filtered reader: the events the bus hands it at publish (and, resuming, those the ring held)."""

    def __init__(self, bus: EventBus, where: Filter, backlog: list[Event]) -> None:
        self._bus = bus
        self.where = where
        self._handed = backlog  # accepted events not read yet
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
            if self._a_ring_behind():
                self.dropped, self._handed = True, []
            if self.dropped:
                return None
            batch, self._handed = self._handed[:max_events], self._handed[max_events:]
            if batch:
                return batch
            if self.closed:  # shut down, and everything published before it has been read
                return None
            if loop.time() >= deadline:
                return []
            self._wake.clear()
            timer = loop.call_at(deadline, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()
            if linger_s and loop.time() < deadline:  # woken by an event, not by the deadline
                await asyncio.sleep(linger_s)

    def _a_ring_behind(self) -> bool:
        """An unread event the ring no longer holds."""
        return bool(self._handed) and self._handed[0].id < self._bus.oldest_id()

    def hand(self, event: Event) -> None:
        """An accepted event, from publish. One a ring behind is dropped here as well, so it
        never holds events the ring has let go."""
        if self._a_ring_behind():
            self.dropped, self._handed = True, []
        if not self.dropped:
            self._handed.append(event)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()


def first_id_of_this_run() -> int:
    """The first event id of a daemon run: microseconds since the epoch. A run publishes far fewer than
    one event a microsecond, so its ids stay below the next run's first: an id from an earlier run is
    told apart at resume (unless the clock was set back between the two runs)."""
    return time.time_ns() // 1000


class EventBus:
    def __init__(self, *, ring_size: int = RING_SIZE, clock: Callable[[], float] = time.time,
                 first_id: int = 1) -> None:
        self.ring_size = ring_size
        self._ring: list[Event | None] = [None] * ring_size
        # Each event's encoded form (the SSE frame), beside it: subscribers reading the same events share
        # one encoding, and a contiguous run of them is one slice, with no Python step per event.
        self._encoded: list[bytes | None] = [None] * ring_size
        self.first_id = first_id
        self.next_id = first_id
        self._sleeping: set[Sleeper] = set()
        self._subscribers: set[Subscription] = set()
        self._by_task: dict[str, list[Subscription]] = {}  # filtered on a task id (and maybe names)
        self._by_name_only: list[Subscription] = []         # filtered on names alone
        self._name_routes: dict[str, list[Subscription]] = {}  # event name -> which of those accept it
        self._clock = clock
        self._listeners: list[Listener] = []  # of every event
        self._named: dict[str, list[tuple[Listener, Callable[[], bool] | None]]] = {}  # of some names
        self._tallies: dict[str, list[Tally]] = {}
        self._failed_tallies: set[str] = set()
        self._closed = False

    def publish(self, name: str, *args: Any, **data: Any) -> Event:
        """Publish `name` with its data as keywords, or, for an event with a Shape (a task's own steps), as
        the shape's fields in order: their data is then built only if something reads it."""
        # One function, no helpers: eight events a task, and a call costs as much as the rest of a step.
        event = Event(self.next_id, name, self._clock(), None, SHAPES[name], args) if args else Event(
            self.next_id, name, self._clock(), data)
        slot = event.id % self.ring_size
        self._ring[slot] = event
        self._encoded[slot] = None
        self.next_id += 1
        tallies = self._tallies.get(name)
        if tallies:
            self._count(tallies, event, args or SHAPES[name].args_of(data))
        for listener in self._listeners:
            listener(event)
        named = self._named.get(name)
        if named:
            for listener, wanted in named:
                if wanted is None or wanted():
                    listener(event)
        if self._sleeping:
            for sleeper in self._sleeping:
                sleeper.wake()
            self._sleeping.clear()
        if self._by_task or self._by_name_only:
            self._hand_out(event)
        return event

    def _count(self, tallies: list[Tally], event: Event, args: tuple[Any, ...]) -> None:
        try:
            for tally in tallies:
                tally(event.ts, *args)
        except Exception:  # a counting bug must not reach the code that published
            if event.name not in self._failed_tallies:  # said once per event name, not once per task
                self._failed_tallies.add(event.name)
                log.exception("cannot count event %s %r", event.name, event.data)

    def _hand_out(self, event: Event) -> None:
        task_id = event.task_id
        for sub in self._by_task.get(task_id, ()) if task_id is not None else ():
            if sub.where.accepts_name(event.name):
                sub.hand(event)
        if self._by_name_only:
            routes = self._name_routes.get(event.name)
            if routes is None:  # each name is matched against the globs once, not once per event
                routes = self._name_routes[event.name] = [
                    s for s in self._by_name_only if s.where.accepts_name(event.name)]
            for sub in routes:
                sub.hand(event)

    def wake_at_next_publish(self, sleeper: Sleeper) -> None:
        """Call sleeper.wake() once, at the next publish (or at close): an unfiltered reader's wait."""
        self._sleeping.add(sleeper)

    def stop_waking(self, sleeper: Sleeper) -> None:
        self._sleeping.discard(sleeper)

    @property
    def closed(self) -> bool:
        return self._closed

    def listen(self, listener: Listener, *, names: Iterable[str] | None = None,
               wanted: Callable[[], bool] | None = None) -> None:
        """A synchronous in-process listener (metrics, logs); must be cheap and must not block. With `names`,
        of those events only, and with `wanted`, only while it says so (a log level): an emitted event no
        listener takes keeps its data unbuilt."""
        if names is None:
            self._listeners.append(listener)
            return
        for name in names:
            self._named.setdefault(name, []).append((listener, wanted))

    def tally(self, name: str, tally: Tally) -> None:
        """Count an event of a shape from its arguments, `tally(ts, *args)`, without its data: published with
        bare arguments, or with keywords (then its data's fields in the shape's order, None for those it lacks).
        A tally that raises is said once per event name, never raised into the code that published."""
        if name not in SHAPES:
            raise ValueError(f"{name} has no shape: listen to it instead")
        self._tallies.setdefault(name, []).append(tally)

    def subscribe(self, where: Filter, *, after: int | None = None) -> Subscription:
        """Read the future events `where` accepts, or with `after` those the ring still holds past that
        id as well. (Unfiltered readers keep a position in the ring instead: see the API's fan-out.)"""
        backlog = [e for e in self.since(after) if where.accepts(e)] if after is not None else []
        sub = Subscription(self, where, backlog)
        if self._closed:  # the node is shutting down: the stream ends with its final event at once
            sub.closed = True
            return sub
        self._subscribers.add(sub)
        if where.task_id is not None:
            self._by_task.setdefault(where.task_id, []).append(sub)
        else:
            self._by_name_only.append(sub)
            self._name_routes.clear()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)
        if sub.where.task_id is not None:
            subs = self._by_task.get(sub.where.task_id, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._by_task.pop(sub.where.task_id, None)
        elif sub in self._by_name_only:
            self._by_name_only.remove(sub)
            self._name_routes.clear()

    def between(self, first: int, end: int) -> list[Event]:
        """The events with ids first .. end - 1, all of which the ring must still hold."""
        return _window(self._ring, first, end)  # type: ignore[arg-type]  # [oldest_id, next_id) is filled

    def encoded(self, first: int, end: int, encode: Callable[[Event], bytes]) -> list[bytes]:
        """The encoded forms of the events with ids first .. end - 1 (all still in the ring), each made
        by `encode` the first time it is asked for and kept until its slot is reused."""
        forms = _window(self._encoded, first, end)
        if None in forms:  # C speed: usually every form exists already
            for k, form in enumerate(forms):
                if form is None:
                    slot = (first + k) % self.ring_size
                    forms[k] = self._encoded[slot] = encode(self._ring[slot])  # type: ignore[arg-type]
        return forms  # type: ignore[return-value]  # every None was filled

    def oldest_id(self) -> int:
        """The id of the oldest event the ring still holds (the next id when it is empty)."""
        return max(self.first_id, self.next_id - self.ring_size)

    def since(self, after: int) -> list[Event]:
        """Every event past `after` that the ring still holds."""
        return self.between(max(after + 1, self.oldest_id()), self.next_id)

    def close(self) -> None:
        """Shutdown: every subscription ends with its final event, and any made later at once."""
        self._closed = True
        for sub in list(self._subscribers):
            sub.closed = True
            sub.wake()
        self._subscribers.clear()
        for sleeper in self._sleeping:  # the fan-out, waiting for events that will not come now
            sleeper.wake()
        self._sleeping.clear()
        self._by_task.clear()
        self._by_name_only.clear()
        self._name_routes.clear()


def _window(ring: list[T], first: int, end: int) -> list[T]:
    """The slots of ids first .. end - 1 of a ring indexed by id modulo its size, across its end."""
    if end <= first:
        return []
    i, j = first % len(ring), end % len(ring)
    return ring[i:j] if i < j else ring[i:] + ring[:j]
