"""The event stream, GET /v1/events: the event bus as server-sent events, resumable with Last-Event-ID.

Unfiltered streams (dashboards, tails) are written together by the Fanout. A filtered stream (a CLI
following its task) reads its own subscription, which is handed only its events, and is written here.
Either way a stream is written straight to its transport (writer.py), so a client that stops
reading holds no coroutine: it is dropped as a slow subscriber, and its connection is cut if it does
not take its final event within a heartbeat's time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from fnmatch import fnmatchcase

import anyio
from aiohttp import web

from ...errors import InvalidRequest
from ...events import EVENT_NAMES, EventBus, Filter, Subscription
from ...http.answers import Answer
from ...http.guard import ConnectionGuard
from ...http.refusals import Refusal
from ...logs import Outage
from ..operations import DAEMON, Operations
from .fanout import Fanout
from .frames import CONNECTED, GAP, HEARTBEAT, closed_frame, frames
from .writer import BACKLOG_BYTES, HEARTBEAT_S, LINGER_S, MAX_BATCH, Stream, bound_send_buffer

__all__ = ["FANOUT", "GUARD", "MAX_STREAMS", "STREAMS", "EventOut", "Fanout", "StreamLimit", "events"]

log = logging.getLogger("tidepool.api")

# Streams stay open for as long as their clients like: they may hold at most half of the connections a
# node takes (guard.MAX_CONNECTIONS), so that probes, metrics and submits always find one.
MAX_STREAMS = 256
MAX_ID_DIGITS = 20  # no event id has more (they are below 2**64); int() of thousands of digits would raise


class EventOut(Answer):
    """One server-sent event of GET /v1/events; `data` is the event's JSON, `id` absent on stream.* notices."""

    event: str
    data: str
    id: str | None = None


class StreamLimit:
    """How many event streams are open, against their cap."""

    def __init__(self, limit: int = MAX_STREAMS) -> None:
        self.limit = limit
        self.open = 0
        self._full = Outage(log)

    def admit(self) -> bool:
        if self.open >= self.limit:
            self._full.failing("API: %d event streams are open, the most a node serves; more are refused (503)",
                               self.limit)
            return False
        self.open += 1
        self._full.over("API: event streams are admitted again")
        return True

    def release(self) -> None:
        self.open -= 1


FANOUT: web.AppKey[Fanout] = web.AppKey("fanout")
STREAMS: web.AppKey[StreamLimit] = web.AppKey("streams")
# The API's connection guard, which says when a stream's client went away (an app built without a listener has
# none: its streams learn it at their next write).
GUARD: web.AppKey[ConnectionGuard] = web.AppKey("guard")


async def events(request: web.Request) -> web.StreamResponse:
    """The route: one stream, admitted under MAX_STREAMS, until it ends."""
    streams = request.app[STREAMS]
    if not streams.admit():
        raise Refusal(503, "too_many_streams", f"{streams.limit} event streams are open, the most this node serves: "
                                               "try again later, or poll GET /v1/tasks/{id}")
    try:
        guard = request.app.get(GUARD)
        return await _stream(request, request.app[DAEMON], request.app[FANOUT],
                             None if guard is None else guard.when_lost)
    finally:
        streams.release()


async def _filter(request: web.Request, daemon: Operations) -> Filter | None:
    """The stream's filter: one task, and/or event names (`type`, comma-separated or repeated, globs allowed).
    An unknown task or a name that matches no event would stream silence for ever: refused instead."""
    given = (n.strip() for value in request.query.getall("type", ()) for n in value.split(","))
    names = tuple(n for n in given if n)
    for name in names:
        if not any(fnmatchcase(known, name) for known in EVENT_NAMES):
            raise InvalidRequest("type", f"{name!r} matches no event; the events: {', '.join(sorted(EVENT_NAMES))}")
    task_id = request.query.get("task_id") or None
    if task_id is not None:
        await daemon.get(task_id)  # TaskNotFound: 404, as every route answers an unknown task id
    return Filter(task_id, names) if task_id is not None or names else None


def _last_event_id(request: web.Request) -> int | None:
    """The id of the last event the client read (None: a fresh client). The query form is for clients that
    cannot set headers; an empty header is no header, as EventSource sends none before its first event."""
    field, raw = "Last-Event-ID", request.headers.get("Last-Event-ID")
    if not raw:
        field, raw = "last_event_id", request.query.get("last_event_id")
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) <= MAX_ID_DIGITS):  # bare isdigit passes "²"; int() does not
        raise InvalidRequest(field, "expected the id of an event the stream sent (a non-negative integer)")
    return int(raw)


async def _stream(request: web.Request, daemon: Operations, fanout: Fanout,
                 when_lost: Callable[[asyncio.BaseTransport, Callable[[], None]], Callable[[], None]] | None = None,
                 ) -> web.StreamResponse:
    """One stream, until it ends. `when_lost` (the connection guard's) says when its client went away: an
    idle stream would otherwise learn it only at its next write, up to a heartbeat later, holding one of
    the MAX_STREAMS places meanwhile."""
    # Refusals come first, as JSON errors: once the response is prepared only SSE frames can follow.
    last_read = _last_event_id(request)
    where = await _filter(request, daemon)
    bus = daemon.events
    after, gap = _resume_after(bus, last_read)
    # Where the stream starts is fixed now, so that nothing published while the response starts is missed.
    sub = bus.subscribe(where, after=after) if where is not None else None
    next_id = bus.next_id if after is None else max(after + 1, bus.oldest_id())
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    try:
        await response.prepare(request)
        bound_send_buffer(request.transport)
        if gap:
            await response.write(GAP)
        await response.write(CONNECTED)
        if request.transport is None:  # gone already
            return response
        chunked = response.headers.get("Transfer-Encoding", "") == "chunked"
        stream = Stream(request.transport, chunked=chunked, next_id=next_id)
        with anyio.CancelScope() as scope:
            forget = when_lost(request.transport, scope.cancel) if when_lost is not None else None
            try:
                await _serve(stream, response, sub, bus, fanout)
            finally:
                if forget is not None:
                    forget()
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        if sub is not None:
            bus.unsubscribe(sub)
    return response


def _resume_after(bus: EventBus, last_read: int | None) -> tuple[int | None, bool]:
    """The id after which the stream starts (None: with what is published from now on), and whether it
    starts with a stream.gap notice: events the client has not read are gone from the ring."""
    if last_read == 0:  # everything: this run's events from its first
        last_read = bus.first_id - 1
    if last_read is not None and not bus.first_id - 1 <= last_read < bus.next_id:
        # An id this run never gave: the client read an earlier run. It has seen none of this run's
        # events, and those of the earlier run past its id are gone.
        return bus.first_id - 1, True
    return last_read, last_read is not None and bus.oldest_id() > last_read + 1  # judged where the resume starts


async def _serve(stream: Stream, response: web.StreamResponse, sub: Subscription | None, bus: EventBus,
                 fanout: Fanout) -> None:
    """Write the stream until it ends: its own subscription's events, or the fan-out's (which writes the
    final frame itself)."""
    final = b""
    if sub is not None:
        final = await _follow_filtered(stream, sub, bus)
    else:
        await fanout.follow(stream)
    await _finish(stream, response, final)


async def _follow_filtered(stream: Stream, sub: Subscription, bus: EventBus) -> bytes:
    """A filtered stream writes what it is handed, each batch as it comes; its final event once over.
    One whose client leaves its backlog full for a heartbeat's time is dropped as a slow subscriber."""
    while True:
        batch = await sub.next_batch(max_events=MAX_BATCH, timeout_s=HEARTBEAT_S, linger_s=LINGER_S)
        if batch is None:  # dropped for falling behind, or the node is shutting down
            return closed_frame("slow subscriber" if sub.dropped else "shutdown")
        if not await stream.drained(limit=BACKLOG_BYTES, within_s=HEARTBEAT_S):
            return closed_frame("slow subscriber")
        if not stream.send(frames(bus, batch) if batch else HEARTBEAT):
            return b""  # the connection is gone


async def _finish(stream: Stream, response: web.StreamResponse, final: bytes) -> None:
    """The final event, then the end of the body once the client has taken everything. One that does not
    within a heartbeat's time (a client dropped as slow may never read again) has its connection cut:
    closing it gracefully would wait for those bytes for ever, holding one of the connections."""
    if final:
        stream.send(final)
    if await stream.drained(limit=0, within_s=HEARTBEAT_S):
        await response.write_eof()
    else:
        stream.abort()

