"""GET /v1/events: the event bus as server-sent events, resumable with Last-Event-ID.

Unfiltered streams (dashboards, tails) are written together by one Fanout. Each time events arrive
it waits a linger for more, encodes each event once, frames the run once, and writes the same bytes
to every stream at that position: one send per stream and no coroutine step per stream; a stream
that is behind and can take more is written again at once. A filtered stream (a CLI following its
task) reads its own subscription, which is handed only its events.

Every stream is written straight to its transport, never through aiohttp's drain, so a client that
stops reading holds no coroutine: it is dropped as a slow subscriber, and its connection is cut if it
does not take its final event within a heartbeat's time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

import anyio
import orjson
from aiohttp import web

from ..errors import InvalidRequest
from ..events import EVENT_NAMES, Event, EventBus, Filter, Subscription
from ..logs import Outage
from ..model import rfc3339

if TYPE_CHECKING:
    from .ops import Operations

log = logging.getLogger("tidepool.api")

HEARTBEAT_S = 15.0
# The kernel's send buffer is part of a subscriber's backlog: autotuned, it grows to megabytes and hides
# a stalled reader from the bounded queue for tens of thousands of events. Fixed, it holds ~1k events.
SEND_BUFFER = 128 * 1024
MAX_BATCH = 512  # events written to one stream in one go
LINGER_S = 0.02  # an event waits at most this long for others to share its write
# A stream with more than this still queued in its transport (beyond the send buffer) is not written
# to until it drains; once its next event has left the ring it is dropped.
BACKLOG_BYTES = 64 * 1024
BACKLOGGED_POLL_S = 0.25
# Streams stay open for as long as their clients like: they may hold at most half of the connections a
# node takes (guard.MAX_CONNECTIONS), so that probes, metrics and submits always find one.
MAX_STREAMS = 256
MAX_ID_DIGITS = 20  # no event id has more (they are below 2**64); int() of thousands of digits would raise


def frame(event: Event) -> bytes:
    """The event as one SSE frame (the bus keeps it: each event is encoded once for every subscriber).

    orjson: every event of every task is encoded once a subscriber follows (measured: 5.7 µs an
    event with json, 2.5 with orjson)."""
    data = {"id": event.id, "event": event.name, "ts": rfc3339(event.ts), **event.data}
    if isinstance(at := data.get("available_at"), float):  # kept a float on the bus, for the metrics
        data["available_at"] = rfc3339(at)
    try:
        text = orjson.dumps(data, default=str)
    except TypeError:  # what orjson refuses (an integer past 64 bits), json writes
        text = json.dumps(data, default=str).encode()
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (event.id, event.name.encode(), text)


def frames(bus: EventBus, batch: list[Event]) -> bytes:
    """One write's bytes, from the bus's encoded frames (a batch just read is all still in the ring): a
    contiguous run is one slice; a filtered batch goes event by event."""
    first, last = batch[0].id, batch[-1].id
    if last - first + 1 == len(batch):
        return frames_between(bus, first, last + 1)
    return b"".join([bus.encoded(e.id, e.id + 1, frame)[0] for e in batch])


def frames_between(bus: EventBus, first: int, end: int) -> bytes:
    """The frames of the events with ids first .. end - 1 (all still in the ring), as one write."""
    return b"".join(bus.encoded(first, end, frame))


def closed_frame(reason: str) -> bytes:
    return f"event: stream.closed\ndata: {json.dumps({'reason': reason})}\n\n".encode()


def chunk(data: bytes) -> bytes:
    """`data` as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


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


class Stream:
    """One event stream's connection, written straight to its transport (by the Fanout once it follows),
    never through aiohttp's drain: a client that stops reading must not hold a coroutine for ever."""

    def __init__(self, transport: asyncio.Transport, *, chunked: bool, next_id: int) -> None:
        self._transport = transport
        self._direct = transport.get_extra_info("sslcontext") is None  # a TLS transport must encrypt it
        self.chunked = chunked   # HTTP/1.1; an HTTP/1.0 client gets the frames themselves
        self.next_id = next_id   # the first event it has not been sent
        self.last_sent = time.monotonic()
        self.ended = anyio.Event()
        self._stalled: tuple[float, int] | None = None  # since when its backlog has been full, and its size

    @property
    def backlogged(self) -> bool:
        return self._transport.get_write_buffer_size() > BACKLOG_BYTES

    def stalled_for(self, now: float) -> float:
        """How long its backlog has been full without its client taking a byte of it (0 if it is not)."""
        queued = self._transport.get_write_buffer_size()
        if queued <= BACKLOG_BYTES:
            self._stalled = None
            return 0.0
        if self._stalled is None or queued < self._stalled[1]:  # (newly) full, or the client took some
            self._stalled = (now, queued)
        return now - self._stalled[0]

    def wire(self, frames: bytes) -> bytes:
        """`frames` as this connection sends them: an HTTP/1.1 chunk, or as they are for HTTP/1.0."""
        return chunk(frames) if self.chunked else frames

    def send(self, frames: bytes) -> bool:
        return self.write(self.wire(frames))

    def write(self, data: bytes) -> bool:
        """Write `data` (as wire() made it) after whatever is still queued; False if the connection is gone.

        With nothing queued, the bytes go straight to the socket with os.write, which lets go of the GIL
        while the kernel copies them (the transport's own write holds it throughout): the SQLite writer
        thread runs meanwhile. What the socket does not take is queued on the transport, in order."""
        if self._transport.is_closing():  # checked right before the write: the socket is still ours
            return False
        sent = 0
        sock = self._transport.get_extra_info("socket")
        if self._direct and sock is not None and not self._transport.get_write_buffer_size():
            try:
                sent = os.write(sock.fileno(), data)
            except BlockingIOError:
                pass
            except OSError:  # reset or gone: the transport finds out on its own side
                return False
        if sent < len(data):
            self._transport.write(data[sent:])
        self.last_sent = time.monotonic()
        return True

    async def drained(self, *, limit: int, within_s: float) -> bool:
        """Wait until at most `limit` bytes are queued; False if the client did not take them in time.

        A poll, not aiohttp's drain under a deadline: a cancelled drain leaves its protocol's waiter
        cancelled, and every later drain on that connection raises CancelledError at once (found with a
        client that never reads). No event says when a buffer has emptied; only a stalled client waits."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while self._transport.get_write_buffer_size() > limit:
            if self._transport.is_closing() or loop.time() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def abort(self) -> None:
        self._transport.abort()


class Fanout:
    """Writes every unfiltered stream, for as long as the API serves: see the module docstring."""

    def __init__(self, bus: EventBus, *, stall_s: float = HEARTBEAT_S) -> None:
        self._bus = bus
        self._stall_s = stall_s  # a stream whose client takes nothing of a full backlog this long is dropped
        self._streams: set[Stream] = set()
        self._wake = asyncio.Event()
        self._closed = False

    async def follow(self, stream: Stream) -> None:
        """Send the stream every event from its next_id on, until it ends (shutdown, dropped, gone)."""
        if self._closed or self._bus.closed:
            self._end(stream, closed_frame("shutdown"))
            return
        self._streams.add(stream)
        self._wake.set()
        try:
            await stream.ended.wait()
        finally:
            self._streams.discard(stream)

    def wake(self) -> None:
        """From the bus: events were published (or it closed)."""
        self._wake.set()

    async def run(self) -> None:
        """Serve the streams; wait without a timer while there are none."""
        try:
            while True:
                if not self._streams:
                    self._wake.clear()
                    await self._wake.wait()
                elif self._bus.closed:
                    self.close()
                else:
                    try:
                        await self._serve_once()
                    except Exception:  # a bug here must cost the streams, not the API
                        log.exception("event streams: the fan-out failed; ending every stream")
                        for stream in list(self._streams):
                            self._drop(stream)
        finally:
            self._bus.stop_waking(self)

    def close(self) -> None:
        """Shutdown: every stream gets what was published before it (all of it: this is the last write),
        then its final event. Synchronous, so that no cancellation can come between."""
        self._closed = True
        end, oldest = self._bus.next_id, self._bus.oldest_id()
        for stream in list(self._streams):
            if stream.next_id < oldest:
                self._end(stream, closed_frame("slow subscriber"))
                continue
            rest = frames_between(self._bus, stream.next_id, end)
            if not rest or self._send(stream, rest):
                self._end(stream, closed_frame("shutdown"))

    async def _serve_once(self) -> None:
        """Write what is new. A stream that is behind and can take more is written again at once;
        otherwise wait for events (then linger for what follows), or for a heartbeat's time."""
        if any(s.next_id < self._bus.next_id and not s.backlogged for s in self._streams):
            await asyncio.sleep(0)  # the pool's callbacks run between two rounds of writes
        else:
            self._wake.clear()
            self._bus.wake_at_next_publish(self)
            behind = any(s.next_id < self._bus.next_id for s in self._streams)  # and not reading
            heartbeat_due = min(s.last_sent for s in self._streams) + HEARTBEAT_S - time.monotonic()
            with anyio.move_on_after(BACKLOGGED_POLL_S if behind else max(0.0, heartbeat_due)) as waited:
                await self._wake.wait()
            if not waited.cancelled_caught and not self._bus.closed:
                await asyncio.sleep(LINGER_S)
        if not self._bus.closed:  # else run() ends the streams with what is left
            self._write_all()
            self._heartbeat_idle()

    def _write_all(self) -> None:
        """Each stream gets the events past its position; streams at one position share one encoding, and
        one copy of the bytes on the wire (framed as a chunk once, not once a stream: a write is ~100 KB)."""
        end, oldest, now = self._bus.next_id, self._bus.oldest_id(), time.monotonic()
        shared: dict[tuple[int, int, bool], bytes] = {}
        for stream in list(self._streams):
            first = stream.next_id
            if first < oldest or stream.stalled_for(now) >= self._stall_s:  # fell a ring behind, or stopped
                self._end(stream, closed_frame("slow subscriber"))
            elif first < end and not stream.backlogged:
                upto = min(end, first + MAX_BATCH)
                key = (first, upto, stream.chunked)
                if key not in shared:
                    shared[key] = stream.wire(frames_between(self._bus, first, upto))
                if not self._write(stream, shared[key]):
                    continue
                stream.next_id = upto

    def _heartbeat_idle(self) -> None:
        """A comment line to each stream sent nothing for a heartbeat's time: proxies keep it open, and a
        reader that went away is found out by the write."""
        now = time.monotonic()
        for stream in list(self._streams):
            if now - stream.last_sent >= HEARTBEAT_S:
                self._send(stream, b": heartbeat\n\n")

    def _send(self, stream: Stream, frames: bytes) -> bool:
        return self._write(stream, stream.wire(frames))

    def _write(self, stream: Stream, data: bytes) -> bool:
        """One stream's write; a stream whose connection is gone, or whose write fails, ends alone."""
        try:
            if stream.write(data):
                return True
        except Exception:  # one stream's failure must not end the others, nor the API
            log.exception("event stream: write failed; ending the stream")
        self._drop(stream)
        return False

    def _end(self, stream: Stream, final: bytes) -> None:
        """The stream's last frame; its handler then returns."""
        self._send(stream, final)
        self._drop(stream)

    def _drop(self, stream: Stream) -> None:
        """No more writes to it; its handler returns."""
        self._streams.discard(stream)
        stream.ended.set()


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


async def events(request: web.Request, daemon: Operations, fanout: Fanout,
                 when_lost: Callable[[asyncio.BaseTransport, Callable[[], None]], Callable[[], None]] | None = None,
                 ) -> web.StreamResponse:
    """One stream, until it ends. `when_lost` (the connection guard's) says when its client went away: an
    idle stream would otherwise learn it only at its next write, up to a heartbeat later, holding one of
    the MAX_STREAMS places meanwhile."""
    # Refusals come first, as JSON errors: once the response is prepared only SSE frames can follow.
    after = _last_event_id(request)
    where = await _filter(request, daemon)
    bus = daemon.events
    if after == 0:  # everything: this run's events from its first
        after = bus.first_id - 1
    if after is not None and not bus.first_id - 1 <= after < bus.next_id:
        # An id this run never gave: the client read an earlier run. It has seen none of this run's
        # events, and those of the earlier run past its id are gone.
        after, gap = bus.first_id - 1, True
    else:
        gap = after is not None and bus.oldest_id() > after + 1  # judged where the resume starts
    # Where the stream starts is fixed now, so that nothing published while the response starts is missed.
    sub = bus.subscribe(where, after=after) if where is not None else None
    next_id = bus.next_id if after is None else max(after + 1, bus.oldest_id())
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    try:
        await response.prepare(request)
        _bound_send_buffer(request)
        if gap:
            await response.write(b"event: stream.gap\ndata: {\"missed\": true}\n\n")
        await response.write(b": connected\n\n")
        if request.transport is None:  # gone already
            return response
        chunked = response.headers.get("Transfer-Encoding", "") == "chunked"
        stream = Stream(request.transport, chunked=chunked, next_id=next_id)
        with anyio.CancelScope() as scope:
            forget = when_lost(request.transport, scope.cancel) if when_lost is not None else None
            try:
                final = b""
                if sub is not None:
                    final = await _follow_filtered(stream, sub, bus)
                else:
                    await fanout.follow(stream)
                await _finish(stream, response, final)
            finally:
                if forget is not None:
                    forget()
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        if sub is not None:
            bus.unsubscribe(sub)
    return response


async def _follow_filtered(stream: Stream, sub: Subscription, bus: EventBus) -> bytes:
    """A filtered stream writes what it is handed, each batch as it comes; its final event once over.
    One whose client leaves its backlog full for a heartbeat's time is dropped as a slow subscriber."""
    while True:
        batch = await sub.next_batch(max_events=MAX_BATCH, timeout_s=HEARTBEAT_S, linger_s=LINGER_S)
        if batch is None:  # dropped for falling behind, or the node is shutting down
            return closed_frame("slow subscriber" if sub.dropped else "shutdown")
        if not await stream.drained(limit=BACKLOG_BYTES, within_s=HEARTBEAT_S):
            return closed_frame("slow subscriber")
        if not stream.send(frames(bus, batch) if batch else b": heartbeat\n\n"):
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


def _bound_send_buffer(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
