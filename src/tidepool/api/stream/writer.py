"""The stream writer: one event stream's connection, written straight to its transport, never through
aiohttp's drain.

A client that stops reading must not hold a coroutine for ever: its backlog is measured here, and the
fan-out or its handler drops it as a slow subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time

import anyio

from .frames import chunk

# A stream that sent nothing this long gets a comment line (proxies keep it open, and a reader that went
# away is found out by the write); one whose client takes nothing of a full backlog this long is dropped.
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



def bound_send_buffer(transport: asyncio.BaseTransport | None) -> None:
    """Fix the socket's send buffer at SEND_BUFFER (see there)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
