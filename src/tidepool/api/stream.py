"""GET /v1/events: the event bus as server-sent events, resumable with Last-Event-ID."""

from __future__ import annotations

import contextlib
import json
import socket
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from ..events import Event
from ..model import rfc3339

if TYPE_CHECKING:
    from ..service import Daemon

HEARTBEAT_S = 15.0
# The kernel's send buffer is part of a subscriber's backlog: autotuned, it grows to megabytes and hides
# a stalled reader from the bounded queue for tens of thousands of events. Fixed, it holds ~1k events.
SEND_BUFFER = 128 * 1024
MAX_BATCH = 512  # events written to one subscriber in one go
LINGER_S = 0.02  # an event waits at most this long for others to share its write


def frame(event: Event) -> bytes:
    """The event as one SSE frame, encoded once however many subscribers send it.

    orjson: every event of every task is encoded once a subscriber follows (measured: 5.7 µs an
    event with json, 2.5 with orjson, most of the daemon's extra work for 20 subscribers)."""
    if event.encoded is None:
        data = {"id": event.id, "event": event.name, "ts": rfc3339(event.ts), **event.data}
        try:
            text = orjson.dumps(data, default=str)
        except TypeError:  # what orjson refuses (an integer past 64 bits), json writes
            text = json.dumps(data, default=str).encode()
        event.encoded = b"id: %d\nevent: %s\ndata: %s\n\n" % (event.id, event.name.encode(), text)
    return event.encoded


class _LastRun:
    """The frames of the last contiguous run of events joined for a write. Unfiltered subscribers woken
    by the same events read the same run: the others write it without touching each event again."""

    first: Event | None = None  # held, so these objects stay alive and `is` cannot match a newcomer
    last: Event | None = None
    joined = b""


def _frames(batch: list[Event]) -> bytes:
    first, last = batch[0], batch[-1]
    contiguous = last.id - first.id + 1 == len(batch)  # then its first and last event say what it holds
    if contiguous and first is _LastRun.first and last is _LastRun.last:
        return _LastRun.joined
    joined = b"".join([frame(e) for e in batch])
    if contiguous:
        _LastRun.first, _LastRun.last, _LastRun.joined = first, last, joined
    return joined


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

    sub = daemon.events.subscribe(accept=accept if task_id is not None or names else None, after=after)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    try:
        await response.prepare(request)
        _bound_send_buffer(request)
        if after is not None and daemon.events.oldest_id() > after + 1:
            await response.write(b"event: stream.gap\ndata: {\"missed\": true}\n\n")
        await response.write(b": connected\n\n")
        while True:
            batch = await sub.next_batch(max_events=MAX_BATCH, timeout_s=HEARTBEAT_S, linger_s=LINGER_S)
            if batch is None:  # dropped for falling behind, or the node is shutting down
                reason = "slow subscriber" if sub.dropped else "shutdown"
                await response.write(f"event: stream.closed\ndata: {json.dumps({'reason': reason})}\n\n".encode())
                break
            await response.write(_frames(batch) if batch else b": heartbeat\n\n")
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        daemon.events.unsubscribe(sub)
    return response


def _bound_send_buffer(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
