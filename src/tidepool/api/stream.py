"""GET /v1/events: the event bus as server-sent events, resumable with Last-Event-ID."""

from __future__ import annotations

import contextlib
import json
import socket
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

import anyio
from aiohttp import web

from ..events import Event, Subscription
from ..model import rfc3339

if TYPE_CHECKING:
    from ..service import Daemon

HEARTBEAT_S = 15.0
SUBSCRIBER_QUEUE = 10_000
# The kernel's send buffer is part of a subscriber's backlog: autotuned, it grows to megabytes and hides
# a stalled reader from the bounded queue for tens of thousands of events. Fixed, it holds ~1k events.
SEND_BUFFER = 128 * 1024
MAX_BATCH = 512  # events written to one subscriber in one go
FRAME_CACHE = 4096
_frames: dict[int, tuple[Event, bytes]] = {}  # by event id: every subscriber sends the same bytes


def frame(event: Event) -> bytes:
    """The event as one SSE frame, encoded once however many subscribers send it."""
    cached = _frames.get(event.id)
    if cached is not None and cached[0] is event:
        return cached[1]
    data = {"id": event.id, "event": event.name, "ts": rfc3339(event.ts), **event.data}
    encoded = f"id: {event.id}\nevent: {event.name}\ndata: {json.dumps(data, default=str)}\n\n".encode()
    if len(_frames) >= FRAME_CACHE:
        del _frames[next(iter(_frames))]  # the oldest: ids only grow
    _frames[event.id] = (event, encoded)
    return encoded


def _filter(request: web.Request) -> tuple[str | None, list[str]]:
    task_id = request.query.get("task_id") or None
    names = [n for n in request.query.get("type", "").split(",") if n]
    return task_id, names


async def events(request: web.Request, daemon: Daemon) -> web.StreamResponse:
    task_id, names = _filter(request)
    raw_last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    after = int(raw_last) if raw_last and raw_last.isdigit() else None

    def accept(e: Event) -> bool:
        return (task_id is None or e.data.get("task_id") == task_id) and \
            (not names or any(fnmatchcase(e.name, n) for n in names))

    sub = daemon.events.subscribe(maxsize=SUBSCRIBER_QUEUE, accept=accept, after=after)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    try:
        await response.prepare(request)
        _bound_send_buffer(request)
        if after is not None and daemon.events.oldest_id() > after + 1:
            await response.write(b"event: stream.gap\ndata: {\"missed\": true}\n\n")
        await response.write(b": connected\n\n")
        while True:
            ready = await _ready(sub)
            chunk = b"".join(frame(e) for e in ready if e is not None) if ready else b": heartbeat\n\n"
            if ready and ready[-1] is None:  # dropped for falling behind, or the node is shutting down
                reason = "slow subscriber" if sub.dropped else "shutdown"
                await response.write(chunk + f"event: stream.closed\ndata: {json.dumps({'reason': reason})}\n\n"
                                     .encode())
                break
            await response.write(chunk)
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        daemon.events.unsubscribe(sub)
    return response


async def _ready(sub: Subscription) -> list[Event | None]:
    """What has piled up for `sub` (one write instead of one per event), waiting up to HEARTBEAT_S for the
    first; [] if nothing came. A None, last, means the bus closed the subscription."""
    with anyio.move_on_after(HEARTBEAT_S):
        ready = [await sub.get()]
        queue = sub._queue  # Subscription has no non-blocking read of its own
        while ready[-1] is not None and not queue.empty() and len(ready) < MAX_BATCH:
            ready.append(queue.get_nowait())
        return ready
    return []


def _bound_send_buffer(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
