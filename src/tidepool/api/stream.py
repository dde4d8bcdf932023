"""GET /v1/events: the event bus as server-sent events, resumable with Last-Event-ID."""

from __future__ import annotations

import contextlib
import json
import socket
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from ..events import Event, EventBus, Filter
from ..model import rfc3339

if TYPE_CHECKING:
    from ..service import Daemon

HEARTBEAT_S = 15.0
# The kernel's send buffer is part of a subscriber's backlog: autotuned, it grows to megabytes and hides
# a stalled reader from the bounded queue for tens of thousands of events. Fixed, it holds ~1k events.
SEND_BUFFER = 128 * 1024
MAX_BATCH = 512  # events written to one subscriber in one go


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
    contiguous run, what unfiltered subscribers read, is one slice; a filtered batch goes event by event."""
    first, last = batch[0].id, batch[-1].id
    if last - first + 1 == len(batch):
        return b"".join(bus.encoded(first, last + 1, frame))
    return b"".join([bus.encoded(e.id, e.id + 1, frame)[0] for e in batch])


def chunk(body: bytes) -> bytes:
    """`body` as one HTTP/1.1 chunk of a chunked response."""
    return b"%x\r\n%s\r\n" % (len(body), body)


class SharedChunks:
    """Recent runs of events, each framed once as an HTTP chunk for every subscriber that reads it.

    The subscribers the bus wakes together read the same runs: each of 20 joining ~60 KB of frames and
    framing a copy through aiohttp was a third of what they cost the event loop (measured). A few runs
    are kept, as a burst is read in several (MAX_BATCH) by one subscriber after another."""

    KEEP = 8

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self._runs: dict[tuple[int, int], bytes] = {}

    def of(self, batch: list[Event]) -> bytes:
        key = (batch[0].id, batch[-1].id)
        framed = self._runs.get(key)
        if framed is None:
            if len(self._runs) >= self.KEEP:
                del self._runs[next(iter(self._runs))]  # the oldest
            framed = self._runs[key] = chunk(frames(self._bus, batch))
        return framed


def _filter(request: web.Request) -> Filter | None:
    task_id = request.query.get("task_id") or None
    names = tuple(n for n in request.query.get("type", "").split(",") if n)
    return Filter(task_id, names) if task_id is not None or names else None


async def events(request: web.Request, daemon: Daemon, shared: SharedChunks) -> web.StreamResponse:
    raw_last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    after = int(raw_last) if raw_last and raw_last.isdigit() else None
    gap = after is not None and daemon.events.oldest_id() > after + 1  # judged where the resume starts
    sub = daemon.events.subscribe(where=_filter(request), after=after)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    try:
        await response.prepare(request)
        chunked = response.headers.get("Transfer-Encoding") == "chunked"  # not for an HTTP/1.0 client
        _bound_send_buffer(request)
        if gap:
            await response.write(b"event: stream.gap\ndata: {\"missed\": true}\n\n")
        await response.write(b": connected\n\n")
        while True:
            batch = await sub.next_batch(max_events=MAX_BATCH, timeout_s=HEARTBEAT_S)
            if batch is None:  # dropped for falling behind, or the node is shutting down
                reason = "slow subscriber" if sub.dropped else "shutdown"
                await response.write(f"event: stream.closed\ndata: {json.dumps({'reason': reason})}\n\n".encode())
                break
            if not batch:
                await response.write(b": heartbeat\n\n")
            elif sub.where is None and chunked:
                await _send(request, shared.of(batch))
            else:
                await response.write(frames(daemon.events, batch))
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        daemon.events.unsubscribe(sub)
    return response


async def _send(request: web.Request, framed: bytes) -> None:
    """An already framed chunk straight to the transport (aiohttp would frame a copy of it), then wait
    while the transport's buffer is over its limit, as aiohttp's own write does. Only for a chunked,
    uncompressed response once prepare() has sent its headers."""
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the subscriber has gone")
    transport.write(framed)
    await request.writer.drain()


def _bound_send_buffer(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
