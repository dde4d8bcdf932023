"""GET /v1/events: the event bus as server-sent events, resumable with Last-Event-ID.

Unfiltered streams (dashboards, tails) are written together by one Fanout. Each time events arrive
it waits a linger for more, encodes each event once, frames the run once, and writes the same bytes
to every stream at that position: one send per stream and no coroutine step per stream. A filtered
stream (a CLI following its task) reads its own subscription, which is handed only its events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from typing import TYPE_CHECKING

import anyio
import orjson
from aiohttp import web

from ..events import Event, EventBus, Filter, Subscription
from ..model import rfc3339

if TYPE_CHECKING:
    from ..service import Daemon

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


def frame(event: Event) -> bytes:
    """The event as one SSE frame (the bus keeps it: each event is encoded once for every subscriber).

    orjson: every event of every task is encoded once a subscriber follows (measured: 5.7 µs an
    event with json, 2.5 with orjson)."""
    data = {"id": event.id, "event": event.name, "ts": rfc3339(event.ts), **event.data}
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
        return b"".join(bus.encoded(first, last + 1, frame))
    return b"".join([bus.encoded(e.id, e.id + 1, frame)[0] for e in batch])


def closed_frame(reason: str) -> bytes:
    return f"event: stream.closed\ndata: {json.dumps({'reason': reason})}\n\n".encode()


def chunk(data: bytes) -> bytes:
    """`data` as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Stream:
    """One unfiltered stream's connection, written only by the Fanout once it follows."""

    def __init__(self, transport: asyncio.Transport, *, chunked: bool, next_id: int) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        self._fd: int | None = sock.fileno() if sock is not None else None
        self.chunked = chunked   # HTTP/1.1; an HTTP/1.0 client gets the frames themselves
        self.next_id = next_id   # the first event it has not been sent
        self.last_sent = time.monotonic()
        self.ended = anyio.Event()

    @property
    def backlogged(self) -> bool:
        return self._transport.get_write_buffer_size() > BACKLOG_BYTES

    def send(self, data: bytes) -> bool:
        """Write `data` (already framed) after whatever is still queued; False once the connection is gone.

        With nothing queued, the bytes go straight to the socket with os.write, which lets go of the GIL
        while the kernel copies them (the transport's own write holds it throughout): the SQLite writer
        thread runs meanwhile. What the socket does not take is queued on the transport, in order."""
        if self._transport.is_closing():
            self.end()
            return False
        sent = 0
        if self._fd is not None and not self._transport.get_write_buffer_size():
            try:
                sent = os.write(self._fd, data)
            except BlockingIOError:
                pass
            except OSError:  # reset or gone: the transport finds out on its own side
                self.end()
                return False
        if sent < len(data):
            self._transport.write(data[sent:])
        self.last_sent = time.monotonic()
        return True

    def end(self, final: bytes | None = None) -> None:
        if final is not None and not self.ended.is_set():
            self.send(chunk(final) if self.chunked else final)
        self.ended.set()


class Fanout:
    """Writes every unfiltered stream, for as long as the API serves: see the module docstring."""

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self._streams: set[_Stream] = set()
        self._wake = asyncio.Event()

    async def follow(self, transport: asyncio.Transport, *, chunked: bool, next_id: int) -> None:
        """Send the connection every event from next_id on, until the stream ends (shutdown, dropped, gone)."""
        stream = _Stream(transport, chunked=chunked, next_id=next_id)
        if self._bus.closed:
            stream.end(closed_frame("shutdown"))
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
                    continue
                await self._serve_once()
        finally:
            self._bus.stop_waking(self)

    async def _serve_once(self) -> None:
        """Wait for events, then write; a heartbeat's time at most, less while a stream is behind."""
        if self._bus.closed:
            self._end_all()
            return
        self._wake.clear()
        self._bus.wake_at_next_publish(self)
        with anyio.move_on_after(self._patience()) as waited:
            await self._wake.wait()
        if self._bus.closed:
            return
        if not waited.cancelled_caught:  # woken by events: let what follows ride along
            await asyncio.sleep(LINGER_S)
        else:
            self._heartbeat_idle()
        self._write_all()

    def _patience(self) -> float:
        """How long to wait for events: a stream behind that can take more waits a linger at most; one
        behind whose reader is not reading (backlogged) is looked at again a few times a second."""
        behind = [s for s in self._streams if s.next_id < self._bus.next_id]
        if any(not s.backlogged for s in behind):
            return LINGER_S
        return BACKLOGGED_POLL_S if behind else HEARTBEAT_S

    def _write_all(self) -> None:
        """Each stream gets the events past its position; streams at one position share one encoding."""
        end, oldest = self._bus.next_id, self._bus.oldest_id()
        shared: dict[tuple[int, int, bool], bytes] = {}
        for stream in list(self._streams):
            first = stream.next_id
            if first < oldest:  # its next event has left the ring: it fell too far behind
                self._streams.discard(stream)
                stream.end(closed_frame("slow subscriber"))
            elif first < end and not stream.backlogged:
                upto = min(end, first + MAX_BATCH)
                key = (first, upto, stream.chunked)
                if key not in shared:
                    run = b"".join(self._bus.encoded(first, upto, frame))
                    shared[key] = chunk(run) if stream.chunked else run
                if stream.send(shared[key]):
                    stream.next_id = upto

    def _heartbeat_idle(self) -> None:
        """A comment line to each stream sent nothing for a heartbeat's time: proxies keep it open, and a
        reader that went away is found out by the write."""
        now = time.monotonic()
        for stream in list(self._streams):
            if now - stream.last_sent >= HEARTBEAT_S:
                stream.send(chunk(b": heartbeat\n\n") if stream.chunked else b": heartbeat\n\n")

    def _end_all(self) -> None:
        """Shutdown: every stream gets what was published before it (all of it: this is the last write),
        then the final event."""
        end, oldest = self._bus.next_id, self._bus.oldest_id()
        for stream in list(self._streams):
            if stream.next_id < oldest:
                stream.end(closed_frame("slow subscriber"))
                continue
            if stream.next_id < end:
                run = b"".join(self._bus.encoded(stream.next_id, end, frame))
                stream.send(chunk(run) if stream.chunked else run)
            stream.end(closed_frame("shutdown"))
        self._streams.clear()


def _filter(request: web.Request) -> Filter | None:
    task_id = request.query.get("task_id") or None
    names = tuple(n for n in request.query.get("type", "").split(",") if n)
    return Filter(task_id, names) if task_id is not None or names else None


async def events(request: web.Request, daemon: Daemon, fanout: Fanout) -> web.StreamResponse:
    raw_last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    after = int(raw_last) if raw_last and raw_last.isdigit() else None
    bus = daemon.events
    gap = after is not None and bus.oldest_id() > after + 1  # judged where the resume starts
    where = _filter(request)
    # Where the stream starts is fixed now, so that nothing published while the response starts is missed.
    sub = bus.subscribe(where=where, after=after) if where is not None else None
    next_id = bus.next_id if after is None else max(after + 1, bus.oldest_id())
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    try:
        await response.prepare(request)
        _bound_send_buffer(request)
        if gap:
            await response.write(b"event: stream.gap\ndata: {\"missed\": true}\n\n")
        await response.write(b": connected\n\n")
        if sub is not None:
            await _follow_filtered(response, sub, bus)
        elif request.transport is not None:
            chunked = response.headers.get("Transfer-Encoding", "") == "chunked"
            await fanout.follow(request.transport, chunked=chunked, next_id=next_id)
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        if sub is not None:
            bus.unsubscribe(sub)
    return response


async def _follow_filtered(response: web.StreamResponse, sub: Subscription, bus: EventBus) -> None:
    """A filtered stream writes what it is handed, each batch as it comes."""
    while True:
        batch = await sub.next_batch(max_events=MAX_BATCH, timeout_s=HEARTBEAT_S, linger_s=LINGER_S)
        if batch is None:  # dropped for falling behind, or the node is shutting down
            await response.write(closed_frame("slow subscriber" if sub.dropped else "shutdown"))
            return
        await response.write(frames(bus, batch) if batch else b": heartbeat\n\n")


def _bound_send_buffer(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
