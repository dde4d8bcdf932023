"""The control streams: one server-sent event stream per connected remote worker, on which a cancel, a change
of its state and new work reach it at once, and the connections of each identity, so that a revoke can close
them all and no identity holds more than its share.

A stream's frames wait in a bounded queue; a worker that does not read them is dropped (it reconnects, and
its renewals carry its cancels in the meantime). Wakes are gathered within one turn of the event loop, so a
burst of submits costs each stream one frame. An identity holds at most gateway.max_control_streams streams
(a new one closes its oldest: the worker that opens it is the one that reconnected) and opens none while
disabled; at most gateway.max_connections_per_worker connections (one past it is answered 429 and closed).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tidepool.gateway")
MAX_QUEUED_FRAMES = 1000
REFUSALS_KEPT = 10_000  # identities refused lately, remembered so that their new connections are not held long


def too_many_connections(identity: str, most: int) -> str:
    return f"worker {identity} holds {most} connections already, the most one identity may " \
           "(gateway.max_connections_per_worker)"


def frame(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class ControlStream:
    """The frames waiting for one stream; `closed` once the stream must end, `why` it did (revoked, disabled,
    replaced by a newer one, read too slowly, dropped by the worker, certificate no longer trusted, shutdown)."""

    def __init__(self, identity: str) -> None:
        self.identity = identity
        self._frames: list[bytes] = []
        self._ready = asyncio.Event()
        self.closed = False
        self.why = ""

    def push(self, data: bytes) -> None:
        if self.closed:
            return
        if len(self._frames) >= MAX_QUEUED_FRAMES:
            log.warning("gateway: worker %s reads its control stream too slowly: dropped", self.identity)
            self.close("read too slowly")
            return
        self._frames.append(data)
        self._ready.set()

    def close(self, why: str) -> None:
        if not self.closed:
            self.closed, self.why = True, why
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
        self._streams: dict[str, dict[ControlStream, None]] = {}  # per identity, oldest first
        self._connections: dict[str, set[asyncio.BaseTransport]] = {}
        self._over: set[asyncio.BaseTransport] = set()  # connections past their identity's cap, until they go
        self._refused: OrderedDict[str, str] = OrderedDict()  # identity -> the code of its latest 403, latest last
        self._parked = parked  # identities with a parked acquire: a wake reaches those through it
        self._wakes = 0

    # streams

    def open(self, identity: str, *, most: int) -> tuple[ControlStream, bool]:
        """A new stream of `identity`, and whether its oldest was closed for it (it had `most` open)."""
        streams = self._streams.setdefault(identity, {})
        replaced = len(streams) >= most
        while len(streams) >= most:
            oldest = next(iter(streams))
            del streams[oldest]
            oldest.close("replaced by a newer one")
        stream = ControlStream(identity)
        streams[stream] = None
        return stream, replaced

    def close(self, stream: ControlStream) -> None:
        streams = self._streams.get(stream.identity)
        if streams is not None:
            streams.pop(stream, None)
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
        """A change of the worker's state, told on its streams. A stream open when its worker is disabled stays:
        the cancels of what it still runs reach it there at once."""
        self._send(identity, frame("worker", {"state": state}))
        if state == "enabled":
            self._refused.pop(identity, None)

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

    def join(self, identity: str, transport: asyncio.BaseTransport | None, *, most: int,
             when_lost: Callable[[asyncio.BaseTransport, Callable[[], None]], object]) -> bool:
        """`transport` is a connection of `identity`, kept until it goes: whether it is within the identity's
        `most` connections. One past them does not count, and stays past them."""
        if transport is None:
            return True
        known = self._connections.setdefault(identity, set())
        if transport in known:
            return True
        if transport in self._over:
            return False
        if len(known) >= most:
            self._over.add(transport)
            when_lost(transport, lambda: self._over.discard(transport))
            return False
        known.add(transport)
        when_lost(transport, lambda: self._forget(identity, transport))
        return True

    def _forget(self, identity: str, transport: asyncio.BaseTransport) -> None:
        known = self._connections.get(identity)
        if known is not None:
            known.discard(transport)
            if not known:
                del self._connections[identity]

    def connections(self, identity: str) -> int:
        return len(self._connections.get(identity, ()))

    def refused(self, identity: str, code: str) -> None:
        """The identity was answered a 403 that closes its connection (worker_pending, worker_revoked, ...)."""
        self._refused[identity] = code
        self._refused.move_to_end(identity)
        if len(self._refused) > REFUSALS_KEPT:
            self._refused.popitem(last=False)

    def refusal_of(self, identity: str) -> str | None:
        """The code of the identity's latest such 403, if it has not been enabled since."""
        return self._refused.get(identity)

    def cut_off(self, identity: str, state: str) -> None:
        """A revoked worker: its streams get their last event and end, its connections are closed."""
        self.worker_state(identity, state)
        self.refused(identity, "worker_revoked")
        for stream in list(self._streams.get(identity, ())):
            stream.close(state)
        loop = asyncio.get_running_loop()
        for transport in list(self._connections.get(identity, ())):
            # after the streams' last frames are written: this turn of the loop writes them
            loop.call_later(0.05, transport.abort)  # type: ignore[attr-defined]

    def close_all(self) -> None:
        for streams in list(self._streams.values()):
            for stream in list(streams):
                stream.close("shutdown")
