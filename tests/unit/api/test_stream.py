"""The SSE stream of GET /v1/events: the frame of one event, and the fan-out that writes each stream the frames
past its own position, then the final event, dropping a stream that falls a ring behind or stops reading."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from functools import partial

import anyio

from tidepool.api.stream.fanout import Fanout
from tidepool.api.stream.frames import frame
from tidepool.api.stream.writer import Stream
from tidepool.events import EventBus
from tidepool.model import State


def publish(bus: EventBus, n: int) -> None:
    for i in range(n):
        bus.publish("task.phase", task_id=f"t{i % 3}", phase="run")


def test_a_frame_carries_the_event_as_json_even_what_orjson_refuses() -> None:
    bus = EventBus(clock=lambda: 1_700_000_000.25)
    event = bus.publish("task.progress", task_id="t1", message="é ✓", huge=2**70, when=State.RUNNING)
    lines = frame(event).decode().split("\n")
    assert lines[:2] == [f"id: {event.id}", "event: task.progress"] and lines[-2:] == ["", ""]
    # the id and the name are the frame's own fields: the data does not say them again
    assert json.loads(lines[2].removeprefix("data: ")) == {
        "ts": "2023-11-14T22:13:20.250000Z", "task_id": "t1", "message": "é ✓", "huge": 2**70, "when": "running"}


class Client:
    """One end of a socket pair: the daemon's side is an asyncio transport a Stream writes to; this side
    reads it as an SSE client would."""

    def __init__(self, transport: asyncio.BaseTransport, sock: socket.socket) -> None:
        self.transport = transport
        self.sock = sock
        self.received = b""

    def stream(self, next_id: int) -> Stream:
        return Stream(self.transport, chunked=False, next_id=next_id)  # type: ignore[arg-type]

    async def read_until(self, *markers: bytes, tail: int | None = None) -> None:
        """Read until one of `markers` is in what arrived (in its last `tail` bytes, if given)."""
        while not any(m in self.received[-tail if tail else 0:] for m in markers):
            data = await asyncio.get_running_loop().sock_recv(self.sock, 1 << 20)
            assert data, "the stream's connection closed early"
            self.received += data


@contextlib.asynccontextmanager
async def clients(n: int = 1) -> AsyncIterator[list[Client]]:
    loop = asyncio.get_running_loop()
    made: list[Client] = []
    pairs = [socket.socketpair() for _ in range(n)]
    try:
        for ours, theirs in pairs:
            theirs.setblocking(False)
            transport, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
            made.append(Client(transport, theirs))
        yield made
    finally:
        for client in made:
            client.transport.close()
        await asyncio.sleep(0)  # the transports let go of their sockets
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def frame_ids(stream: bytes) -> list[int]:
    return [int(line[4:]) for line in stream.decode().splitlines() if line.startswith("id: ")]


async def test_the_fanout_sends_each_stream_the_events_past_its_own_position_then_the_final_event() -> None:
    """Streams at different positions are written in one pass: one from the start, one mid-ring, one caught
    up; a stream at one position never gets another's run."""
    bus = EventBus(ring_size=64)
    publish(bus, 10)  # ids 1..10
    fanout = Fanout(bus)
    starts = (1, 5, 11)
    async with clients(len(starts)) as readers, anyio.create_task_group() as tg:
        tg.start_soon(fanout.run)
        for reader, start in zip(readers, starts, strict=True):
            tg.start_soon(fanout.follow, reader.stream(start))
        publish(bus, 5)  # ids 11..15
        with anyio.fail_after(5):
            for reader in readers:
                await reader.read_until(b"id: 15\n")
        for reader, start in zip(readers, starts, strict=True):
            assert frame_ids(reader.received) == list(range(start, 16)), f"stream from {start}"

        bus.publish("task.finished", task_id="t0", state="completed")  # id 16, then the shutdown
        bus.close()
        with anyio.fail_after(5):
            for reader in readers:
                await reader.read_until(b"event: stream.closed")
        tg.cancel_scope.cancel()
    for reader, start in zip(readers, starts, strict=True):
        assert frame_ids(reader.received) == list(range(start, 17)), "what was published before the shutdown"
        assert reader.received.endswith(b'event: stream.closed\ndata: {"reason": "shutdown"}\n\n')


async def test_a_reading_stream_keeps_up_with_events_faster_than_one_write_a_linger() -> None:
    """~100k events/s, far more than one write of 512 per 20 ms linger: a reader that keeps reading is
    written as fast as it reads and is never dropped."""
    bus = EventBus()  # a ring of 10,000: ~0.1 s of these events
    fanout = Fanout(bus)
    total = 30_000

    async with clients() as (reader,), anyio.create_task_group() as tg:
        tg.start_soon(fanout.run)
        tg.start_soon(fanout.follow, reader.stream(1))
        with anyio.fail_after(30):
            async with anyio.create_task_group() as reading:
                reading.start_soon(partial(reader.read_until, f"id: {total}\n".encode(), b"stream.closed", tail=400))
                for _ in range(total // 200):
                    publish(bus, 200)
                    await anyio.sleep(0.002)
        tg.cancel_scope.cancel()
    assert b"stream.closed" not in reader.received, "a reader that kept reading was dropped as slow"
    assert frame_ids(reader.received) == list(range(1, total + 1))


async def test_streams_cut_off_mid_linger_still_end_with_what_was_published_and_the_final_event() -> None:
    """The API's shutdown cancels the fan-out wherever it waits, then closes it: nothing is lost."""
    bus = EventBus(ring_size=64)
    fanout = Fanout(bus)
    async with clients() as (reader,):
        async with anyio.create_task_group() as handlers:  # aiohttp's handlers: not the API's task group
            handlers.start_soon(fanout.follow, reader.stream(1))
            async with anyio.create_task_group() as api:
                api.start_soon(fanout.run)
                for _ in range(3):
                    await asyncio.sleep(0)  # the stream follows; the fan-out waits for events
                publish(bus, 3)  # wakes it: it lingers 20 ms for more
                await asyncio.sleep(0)
                bus.close()
                api.cancel_scope.cancel()  # as the daemon's shutdown cancels the API, before the linger is over
            fanout.close()
        with anyio.fail_after(5):
            await reader.read_until(b"event: stream.closed")
    assert frame_ids(reader.received) == [1, 2, 3]
    assert reader.received.endswith(b'event: stream.closed\ndata: {"reason": "shutdown"}\n\n')


async def test_a_stream_whose_next_event_has_left_the_ring_is_dropped_with_a_notice() -> None:
    bus = EventBus(ring_size=8)
    publish(bus, 9)  # the ring holds 2..9: a stream still to be sent 1 fell a whole ring behind
    fanout = Fanout(bus)
    async with clients() as (reader,), anyio.create_task_group() as tg:
        tg.start_soon(fanout.run)
        with anyio.fail_after(5):
            await fanout.follow(reader.stream(1))  # returns once the stream has ended
            await reader.read_until(b"\n\n")
        tg.cancel_scope.cancel()
    assert reader.received == b'event: stream.closed\ndata: {"reason": "slow subscriber"}\n\n'


async def test_a_stream_whose_client_takes_nothing_of_its_backlog_is_dropped_before_the_ring_wraps() -> None:
    """On a quiet node the ring may never wrap: a client that stopped reading is dropped by time as well."""
    bus = EventBus()  # 10,000 events: far more than are published here
    fanout = Fanout(bus, stall_s=0.3)
    async with clients() as (reader,):
        async with anyio.create_task_group() as tg:
            tg.start_soon(fanout.run)
            with anyio.fail_after(10):
                async with anyio.create_task_group() as following:
                    following.start_soon(fanout.follow, reader.stream(1))
                    publish(bus, 5000)  # ~1 MB: more than the socket pair and the backlog hold, and nobody reads
                # follow() returned: the stream ended although the ring still holds everything
            tg.cancel_scope.cancel()
        with anyio.fail_after(10):
            await reader.read_until(b"event: stream.closed")
    ids = frame_ids(reader.received)
    assert ids == list(range(1, len(ids) + 1)) and len(ids) < 5000, "a prefix of the stream, then the notice"
    assert reader.received.endswith(b'event: stream.closed\ndata: {"reason": "slow subscriber"}\n\n')
