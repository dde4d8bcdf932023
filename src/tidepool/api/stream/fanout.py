"""The fan-out: one task writes every unfiltered event stream (dashboards, tails).

Each time events arrive it waits a linger for more, encodes each event once, frames the run once, and
writes the same bytes to every stream at that position: one send per stream and no coroutine step per
stream; a stream that is behind and can take more is written again at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio

from ...events import EventBus
from .frames import HEARTBEAT, closed_frame, frames_between
from .writer import BACKLOGGED_POLL_S, HEARTBEAT_S, LINGER_S, MAX_BATCH, Stream

log = logging.getLogger("tidepool.api")


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
                self._send(stream, HEARTBEAT)

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
