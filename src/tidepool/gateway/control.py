"""The control streams: one server-sent event stream per connected remote worker, on which a cancel, a change
of its state and new work reach it at once, and the connections of each identity, so that a revoke can close
them all.

A stream's frames wait in a bounded queue; a worker that does not read them is dropped (it reconnects, and
its renewals carry its cancels in the meantime). Wakes are gathered within one turn of the event loop, so a
burst of submits costs each stream one frame.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tidepool.gateway")
MAX_QUEUED_FRAMES = 1000


def frame(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class ControlStream:
    """The frames waiting for one stream; `closed` once the stream must end (revoked, dropped, shutdown)."""

    def __init__(self, identity: str) -> None:
        self.identity = identity
        self._frames: list[bytes] = []
        self._ready = asyncio.Event()
        self.closed = False

    def push(self, data: bytes) -> None:
        if self.closed:
            return
        if len(self._frames) >= MAX_QUEUED_FRAMES:
            log.warning("gateway: worker %s reads its control stream too slowly: dropped", self.identity)
            self.close()
            return
        self._frames.append(data)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def next_frames(self, timeout_s: float) -> list[bytes]:
        """What is waiting, after up to timeout_s ([] then: time for a keep-alive comment)."""
        if not self._frames and not self.closed:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout_s)
            except TimeoutError:
                return []
        frames, self._frames = self._frames, []
        return frames


class Controls:
    def __init__(self, *, parked: Callable[[], set[str]] = set) -> None:
        self._streams: dict[str, set[ControlStream]] = {}
        self._connections: dict[str, set[asyncio.BaseTransport]] = {}
        self._parked = parked  # identities with a parked acquire: a wake reaches those through it
        self._wakes = 0

    # streams

    def open(self, identity: str) -> ControlStream:
        stream = ControlStream(identity)
        self._streams.setdefault(identity, set()).add(stream)
        return stream

    def close(self, stream: ControlStream) -> None:
        streams = self._streams.get(stream.identity)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self._streams[stream.identity]

    def open_streams(self) -> int:
        return sum(len(s) for s in self._streams.values())

    def connected(self, identity: str) -> bool:
        return bool(self._streams.get(identity))

    def _send(self, identity: str, data: bytes) -> None:
        for stream in list(self._streams.get(identity, ())):
            stream.push(data)

    def cancel(self, identity: str, attempt_id: str) -> None:
        self._send(identity, frame("cancel", {"attempt_id": attempt_id}))

    def worker_state(self, identity: str, state: str) -> None:
        self._send(identity, frame("worker", {"state": state}))

    def wake(self, n: int) -> None:
        """Tell the workers with no acquire parked that n tasks became claimable (gathered per loop turn)."""
        if not self._streams:
            return
        if not self._wakes:
            asyncio.get_running_loop().call_soon(self._flush_wakes)
        self._wakes += n

    def _flush_wakes(self) -> None:
        n, self._wakes = self._wakes, 0
        parked = self._parked()
        data = frame("wake", {"n": n})
        for identity in [i for i in self._streams if i not in parked]:
            self._send(identity, data)

    # connections

    def seen(self, identity: str, transport: asyncio.BaseTransport | None,
             when_lost: Callable[[asyncio.BaseTransport, Callable[[], None]], object]) -> None:
        """A request of `identity` came on `transport`: kept until the connection goes."""
        if transport is None:
            return
        known = self._connections.setdefault(identity, set())
        if transport in known:
            return
        known.add(transport)
        when_lost(transport, lambda: self._forget(identity, transport))

    def _forget(self, identity: str, transport: asyncio.BaseTransport) -> None:
        known = self._connections.get(identity)
        if known is not None:
            known.discard(transport)
            if not known:
                del self._connections[identity]

    def cut_off(self, identity: str, state: str) -> None:
        """A revoked worker: its streams get their last event and end, its connections are closed."""
        self.worker_state(identity, state)
        for stream in list(self._streams.get(identity, ())):
            stream.close()
        loop = asyncio.get_running_loop()
        for transport in list(self._connections.get(identity, ())):
            # after the streams' last frames are written: this turn of the loop writes them
            loop.call_later(0.05, transport.abort)  # type: ignore[attr-defined]

    def close_all(self) -> None:
        for streams in list(self._streams.values()):
            for stream in list(streams):
                stream.close()
