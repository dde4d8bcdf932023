"""GET /v1/events on a live daemon: order, Last-Event-ID resume, filters, slow subscribers, shutdown."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import psutil
import pytest

from .api_helpers import NOOP_EVENTS, EventStream, Sse, shape
from .conftest import UNKNOWN_ID, Daemon


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def submit(session: aiohttp.ClientSession, daemon: Daemon, n: int = 1, **fields: object) -> list[str]:
    async with session.post(f"{daemon.url}/v1/tasks/batch", json={"tasks": [{"type": "noop", **fields}] * n}) as r:
        assert r.status == 201, await r.text()
        ids: list[str] = (await r.json())["ids"]
        return ids


def finished(ids: set[str]) -> Callable[[Sse], bool]:
    """True at the event that finishes the last of `ids` (mutates its own copy)."""
    left = set(ids)

    def done(e: Sse) -> bool:
        if e.event == "task.finished":
            left.discard(e.task_id or "")
        return not left

    return done


def by_task(events: list[Sse], task_id: str) -> list[Sse]:
    return [e for e in events if e.task_id == task_id]


@pytest.mark.e2e
async def test_a_submitted_task_s_events_arrive_in_order(daemon: Daemon, session: aiohttp.ClientSession) -> None:
    stream = await EventStream.open(session, daemon)
    finished_only = await EventStream.open(session, daemon, type="task.finished")
    (task_id,) = await submit(session, daemon)

    events = await stream.until(finished({task_id}))
    mine = by_task(events, task_id)
    assert shape(mine) == NOOP_EVENTS
    assert mine[-1].data["state"] == "completed"
    ids = [e.id for e in events]
    assert all(i is not None for i in ids) and ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(e.data["ts"].endswith("Z") for e in events)
    assert not any("id" in e.data or "event" in e.data for e in events), "said once, in the SSE fields"
    leased = next(e for e in mine if e.event == "task.leased")
    assert leased.data["available_at"].endswith("Z"), "every time in the API is RFC 3339, as the task's"
    assert {e.data["worker_id"] for e in mine[1:]} == {leased.data["worker_id"]}, "one worker ran the attempt"

    (only,) = await finished_only.until(lambda e: True)
    assert (only.event, only.task_id, only.id) == ("task.finished", task_id, mine[-1].id)
    stream.close()
    finished_only.close()


@pytest.mark.e2e
async def test_a_stream_that_joins_while_events_flow_gets_every_one_from_where_it_joined(
        daemon: Daemon, session: aiohttp.ClientSession) -> None:
    """Streams at different positions are written together: the late one neither misses nor repeats."""
    early = await EventStream.open(session, daemon)
    ids = set(await submit(session, daemon, 200, type="sleep", payload={"seconds": 0.05}))
    first = await early.until(lambda e: e.event == "task.finished")  # the pool is at work now
    late = await EventStream.open(session, daemon)
    rest = await early.until(finished(ids - {first[-1].task_id or ""}), timeout_s=60)
    joined = await late.until(lambda e: e.id == rest[-1].id, timeout_s=60)
    early.close()
    late.close()

    everything = first + rest
    assert [e.id for e in everything] == list(range(everything[0].id or 0, (everything[-1].id or 0) + 1))
    assert joined[0].id is not None and everything[0].id is not None
    assert everything[0].id < joined[0].id, "the late stream starts where it joined, not at the beginning"
    assert sum(e.event == "task.finished" for e in joined) > 0, "it joined while tasks still ran"
    tail = [(e.id, e.event, e.task_id) for e in everything if (e.id or 0) >= joined[0].id]
    assert [(e.id, e.event, e.task_id) for e in joined] == tail


@pytest.mark.e2e
async def test_an_http_1_0_client_gets_plain_frames(daemon: Daemon, session: aiohttp.ClientSession) -> None:
    """HTTP/1.0 has no chunked encoding: the stream is the frames themselves, ended by the close."""
    host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /v1/events HTTP/1.0\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
        await reader.readuntil(b": connected\n\n")
        (task_id,) = await submit(session, daemon)
        body = await asyncio.wait_for(reader.readuntil(b"event: task.finished\ndata: "), 10)
        body += await reader.readuntil(b"\n\n")
    finally:
        writer.close()
    frames = [f for f in body.decode().split("\n\n") if f]
    parsed = [dict(line.split(": ", 1) for line in f.split("\n")) for f in frames]  # fails on a chunk size
    mine = [Sse(p["event"], json.loads(p["data"]), int(p["id"])) for p in parsed]
    assert shape([e for e in mine if e.task_id == task_id]) == NOOP_EVENTS


@pytest.mark.e2e
async def test_reconnecting_with_last_event_id_misses_no_event(daemon: Daemon,
                                                               session: aiohttp.ClientSession) -> None:
    first = await EventStream.open(session, daemon)
    batch1 = await submit(session, daemon, 5)
    before = await first.until(lambda e: e.event == "task.finished")  # mid-stream: the rest still to come
    first.close()
    last_id = before[-1].id
    assert last_id is not None

    batch2 = await submit(session, daemon, 5)  # while nobody listens
    daemon.wait_for("all ten tasks to end", lambda: all(
        daemon.task(t)["state"] == "completed" for t in batch1 + batch2))

    second = await EventStream.open(session, daemon, last_id=last_id)
    after = await second.until(finished(set(batch1 + batch2) - {before[-1].task_id or ""}))
    second.close()

    assert not any(e.event == "stream.gap" for e in after)
    ids = [e.id for e in before + after]
    assert ids == list(range(before[0].id or 0, (after[-1].id or 0) + 1)), "ids must run on without gap or repeat"
    for task_id in batch1 + batch2:
        assert shape(by_task(before + after, task_id)) == NOOP_EVENTS, task_id

    # a filtered stream resumes the same way: each task's finish exactly once across the two connections
    finishes = await EventStream.open(session, daemon, last_id=0, type="task.finished")
    early = [await finishes.next() for _ in range(4)]
    finishes.close()
    rest = await EventStream.open(session, daemon, last_id=early[-1].id, type="task.finished")
    late = [await rest.next() for _ in range(6)]
    rest.close()
    assert sorted(e.task_id or "" for e in early + late) == sorted(batch1 + batch2)


@pytest.mark.e2e
async def test_a_last_event_id_from_before_a_restart_replays_this_run_after_a_gap_notice(
        daemon: Daemon, session: aiohttp.ClientSession) -> None:
    """A client that read the last run (the dashboard reconnects like this) has seen none of this run's
    events, and those of the last run past its id are gone: it is told so, then gets this run's from its
    first, even once this run has published more events than the last one had."""
    stream = await EventStream.open(session, daemon)
    before = await stream.until(finished(set(await submit(session, daemon))))
    stream.close()
    last_id = before[-1].id
    assert last_id is not None
    daemon.stop()
    daemon.start()
    async with aiohttp.ClientSession() as fresh:  # the old session's connections died with the last run
        await _resume_after_restart(fresh, daemon, last_id)


async def _resume_after_restart(session: aiohttp.ClientSession, daemon: Daemon, last_id: int) -> None:
    busy = set(await submit(session, daemon, 3))  # this run's event count now passes the last run's
    everything = await EventStream.open(session, daemon, last_id=0)
    first_of_run = (await everything.next()).id
    everything.close()
    assert first_of_run is not None and first_of_run > last_id, "a run's ids lie above the last run's"
    for where in ({}, {"type": "task.*,plugin.*"}):
        resumed = await EventStream.open(session, daemon, last_id=last_id, **where)
        assert [e.event for e in resumed.pending] == ["stream.gap"]
        (task_id,) = await submit(session, daemon)
        events = await resumed.until(finished({task_id}))
        resumed.close()
        assert shape(by_task(events, task_id)) == NOOP_EVENTS
        assert {e.task_id for e in events if e.event == "task.finished"} >= busy, "this run's events before it"
        if not where:
            assert next(e.id for e in events if e.id is not None) == first_of_run, "this run's events from its first"


@pytest.mark.e2e
async def test_a_repeated_cancel_is_a_no_op_that_publishes_nothing(daemon: Daemon,
                                                                   session: aiohttp.ClientSession) -> None:
    """Cancelling a cancelled task changes nothing, so no second task.finished either (it used
    to be published, and counted in the metrics, on every repeat)."""
    finishes = await EventStream.open(session, daemon, type="task.finished,task.cancel_requested")
    later = "2999-01-01T00:00:00Z"
    (task_id,) = await submit(session, daemon, available_at=later)
    for _ in range(3):
        async with session.post(f"{daemon.url}/v1/tasks/{task_id}/cancel") as r:
            assert r.status == 202 and (await r.json())["state"] == "cancelled"
    (marker,) = await submit(session, daemon, available_at=later)
    async with session.post(f"{daemon.url}/v1/tasks/{marker}/cancel") as r:
        assert r.status == 202
    events = await finishes.until(lambda e: e.task_id == marker)
    finishes.close()
    assert [(e.event, e.task_id, e.data["state"], e.data["type"]) for e in events] == [
        ("task.finished", task_id, "cancelled", "noop"), ("task.finished", marker, "cancelled", "noop")]


@pytest.mark.e2e
async def test_filters_by_task_id_and_event_type(daemon: Daemon, session: aiohttp.ClientSession) -> None:
    a, b = await submit(session, daemon, 2)
    daemon.wait_for("both tasks to end", lambda: all(daemon.task(t)["state"] == "completed" for t in (a, b)))

    # Last-Event-ID 0 replays the ring, so the filters are checked on events that already happened
    only_b = await EventStream.open(session, daemon, last_id=0, task_id=b)
    events = await only_b.until(lambda e: e.event == "task.finished")
    only_b.close()
    assert shape(events) == NOOP_EVENTS and {e.task_id for e in events} == {b}

    phases = await EventStream.open(session, daemon, last_id=0, type="task.phase")
    events = [await phases.next() for _ in range(8)]
    phases.close()
    assert {e.event for e in events} == {"task.phase"}
    for task_id in (a, b):
        assert [e.data["phase"] for e in by_task(events, task_id)] == ["initialize", "prepare", "run", "stop"]

    both = await EventStream.open(session, daemon, last_id=0, task_id=a, type="plugin.*,task.finished")
    events = await both.until(lambda e: e.event == "task.finished")
    both.close()
    assert [(e.event, e.task_id) for e in events] == [("plugin.started", a), ("plugin.finished", a),
                                                      ("task.finished", a)]

    # and live: a stream filtered to one task sees nothing of another
    (c,) = await submit(session, daemon, 1, available_at="2999-01-01T00:00:00Z")
    only_c = await EventStream.open(session, daemon, task_id=c)
    await submit(session, daemon, 3)
    async with session.post(f"{daemon.url}/v1/tasks/{c}/cancel") as r:
        assert r.status == 202
    events = await only_c.until(lambda e: e.event == "task.finished")
    only_c.close()
    assert [(e.event, e.task_id, e.data["state"]) for e in events] == [("task.finished", c, "cancelled")]


async def refusal(session: aiohttp.ClientSession, daemon: Daemon, query: list[tuple[str, str]], *,
                  headers: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
    """The status and JSON error of a request that must be refused before its stream starts."""
    async with session.get(f"{daemon.url}/v1/events", params=query, headers=headers or {}) as r:
        assert r.content_type == "application/json", f"{query} {headers}: a {r.status} {r.content_type} answer"
        error: dict[str, str] = (await r.json())["error"]
        return r.status, error


async def replay(session: aiohttp.ClientSession, daemon: Daemon, query: list[tuple[str, str]]) -> EventStream:
    """The ring from its first event (Last-Event-ID: 0), for queries EventStream.open cannot send (a repeated
    parameter): what is replayed happened already, so no `: connected` wait is needed."""
    response = await session.get(f"{daemon.url}/v1/events", params=query, headers={"Last-Event-ID": "0"},
                                 timeout=aiohttp.ClientTimeout(total=None, sock_read=None))
    assert response.status == 200 and response.content_type == "text/event-stream", await response.text()
    return EventStream(response)


@pytest.mark.e2e
async def test_an_unknown_task_id_is_a_404_like_every_route_gives_not_a_silent_stream(
        daemon: Daemon, session: aiohttp.ClientSession) -> None:
    for task_id in (UNKNOWN_ID, "not-a-task-id"):  # the task routes answer a malformed id as an unknown one
        status, error = await refusal(session, daemon, [("task_id", task_id)])
        task_route = daemon.get(f"/v1/tasks/{task_id}")
        assert (status, error["code"]) == (task_route.status, task_route.error["code"]) == (404, "not_found")
        assert task_id in error["message"]
    assert UNKNOWN_ID not in daemon.log(200), "a 404 is not logged, as no other 4xx is"


@pytest.mark.e2e
async def test_a_type_that_matches_no_event_is_a_400_naming_type(daemon: Daemon,
                                                                 session: aiohttp.ClientSession) -> None:
    for query in ([("type", "bogus")], [("type", "nosuch.*")],
                  [("type", "task.created,task.finshed")],          # one typo in a list is not ignored
                  [("type", "task.created"), ("type", "bogus")]):   # nor in a repeated parameter
        status, error = await refusal(session, daemon, query)
        assert (status, error["code"]) == (400, "invalid_request"), query
        assert error["message"].startswith("type: ") and "task.finished" in error["message"], error
    assert "bogus" not in daemon.log(200), "a 400 is not logged, as no other 4xx is"


@pytest.mark.e2e
async def test_a_repeated_type_parameter_counts_every_value(daemon: Daemon, session: aiohttp.ClientSession) -> None:
    (task_id,) = await submit(session, daemon)
    daemon.wait_terminal(task_id)
    stream = await replay(session, daemon, [("type", "plugin.started"), ("type", "task.finished")])
    events = await stream.until(lambda e: e.event == "task.finished")
    stream.close()
    assert [(e.event, e.task_id) for e in events] == [("plugin.started", task_id), ("task.finished", task_id)]


@pytest.mark.e2e
async def test_a_last_event_id_that_is_not_a_non_negative_integer_is_a_400_naming_it(
        daemon: Daemon, session: aiohttp.ClientSession) -> None:
    for value in ("abc", "-5", "1.5", "0x10"):
        status, error = await refusal(session, daemon, [], headers={"Last-Event-ID": value})
        assert (status, error["code"]) == (400, "invalid_request"), value
        assert error["message"].startswith("Last-Event-ID: "), error
    status, error = await refusal(session, daemon, [("last_event_id", "abc")])  # its form for header-less clients
    assert status == 400 and error["message"].startswith("last_event_id: "), error
    assert "Traceback" not in daemon.log(200)


@pytest.mark.e2e
async def test_every_valid_filter_and_resume_form_still_streams(daemon: Daemon,
                                                                session: aiohttp.ClientSession) -> None:
    (task_id,) = await submit(session, daemon)
    daemon.wait_terminal(task_id)
    expected = {  # each query, replayed from Last-Event-ID: 0, and the task's events it must deliver
        (("task_id", task_id),): NOOP_EVENTS,
        (("type", "task.*"),): [n for n in NOOP_EVENTS if n.startswith("task.")],
        (("type", "task.created,task.finished"),): ["task.created", "task.finished"],
        (("type", " task.created , task.finished"),): ["task.created", "task.finished"],
        (("type", "plugin.started"), ("type", "task.finished")): ["plugin.started", "task.finished"],
        (): NOOP_EVENTS,
    }
    for query, names in expected.items():
        stream = await replay(session, daemon, list(query))
        events = await stream.until(lambda e: e.event == "task.finished" and e.task_id == task_id)
        stream.close()
        assert shape(by_task(events, task_id)) == names, query


@pytest.mark.e2e
async def test_a_subscriber_that_never_reads_is_dropped_and_the_pool_keeps_going(
        make_daemon: Callable[..., Daemon], session: aiohttp.ClientSession) -> None:
    daemon = make_daemon({"pool": {"min_workers": 4, "max_workers": 4}, "log": {"level": "warning"}})
    daemon.start()
    # slow reads once the pool is done; the mute ones never read at all: unfiltered, filtered, HTTP/1.0
    slow, *mute = [socket.socket() for _ in range(4)]
    requests = [b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"] * 2 + [
        b"GET /v1/events?type=task.*,plugin.* HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /v1/events HTTP/1.0\r\n\r\n"]
    for sock, request in zip([slow, *mute], requests, strict=True):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        sock.connect(("127.0.0.1", daemon.port))
        sock.sendall(request)
    healthy = await EventStream.open(session, daemon, type="task.finished")

    n = 2500  # ~9 events each: far more than one subscriber's queue and the socket buffers hold
    ids: set[str] = set()
    for _ in range(n // 500):
        ids |= set(await submit(session, daemon, 500))
    seen = await healthy.until(finished(ids), timeout_s=90)
    healthy.close()
    assert len(seen) == n, "a healthy subscriber next to the slow one still gets every event"
    assert daemon.query("SELECT count(*) FROM tasks WHERE state = 'completed'") == [(n,)]

    # Now read what the slow one was sent: a prefix of the stream, then the notice that it was dropped.
    slow.settimeout(10.0)
    received = b""
    deadline = time.monotonic() + 30
    while b"event: stream.closed" not in received and time.monotonic() < deadline:
        chunk = await asyncio.to_thread(slow.recv, 1 << 20)
        if not chunk:
            break
        received += chunk
    slow.close()
    notice = received[received.index(b"event: stream.closed"):]
    data = json.loads(notice.split(b"data: ", 1)[1].split(b"\n", 1)[0])
    assert data == {"reason": "slow subscriber"}
    got = received.count(b"\nevent: task.finished\n")
    assert got < n, f"the slow subscriber cannot have been sent all {n} finishes ({got})"
    ids = [int(line[4:]) for line in received.decode().splitlines() if line.startswith("id: ")]
    assert ids == list(range(ids[0], ids[0] + len(ids))), "what it got is the stream up to the drop, no holes"

    # A client that stops reading is dropped; if it does not read its last bytes within a heartbeat's time
    # (15 s) the daemon lets go of its connection rather than hold one of its connection slots for ever.
    assert daemon.proc is not None
    server = psutil.Process(daemon.proc.pid)
    ports = {sock.getsockname()[1] for sock in mute}
    daemon.wait_for("the daemon to cut the connections of clients that never read", lambda: not any(
        c.raddr and c.raddr.port in ports for c in server.net_connections(kind="tcp")), timeout_s=60)
    for sock in mute:
        sock.close()


@pytest.mark.e2e
async def test_sigterm_ends_open_streams_with_a_final_event(make_daemon: Callable[..., Daemon],
                                                            session: aiohttp.ClientSession) -> None:
    daemon = make_daemon()
    daemon.start()
    streams = [await EventStream.open(session, daemon), await EventStream.open(session, daemon, type="task.*")]
    assert daemon.proc is not None
    daemon.proc.terminate()  # SIGTERM

    for stream in streams:
        tail = await stream.until(lambda e: e.event == "stream.closed", timeout_s=15)
        assert tail[-1].data == {"reason": "shutdown"} and tail[-1].id is None
        with pytest.raises(EOFError):
            await stream.next(timeout_s=10)
        stream.close()
    assert await asyncio.to_thread(daemon.proc.wait, 15) == 0


@pytest.mark.e2e
async def test_streams_cannot_take_every_connection_and_waiting_clients_fall_back_to_polling(
        daemon: Daemon, session: aiohttp.ClientSession) -> None:
    """Streams stay open for as long as their clients like. Past MAX_STREAMS of them a new one is refused
    with 503, so probes, metrics and submits still find a connection, and Client.wait polls instead."""
    from tidepool.api.stream import MAX_STREAMS
    from tidepool.client import Client

    host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
    held = []
    try:
        for _ in range(MAX_STREAMS):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            held.append(s)
        for s in held:  # each one is a stream now
            seen = b""
            while b": connected" not in seen:
                seen += s.recv(4096)
        async with session.get(f"{daemon.url}/v1/events") as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "too_many_streams"
        async with session.get(f"{daemon.url}/healthz") as r:
            assert r.status == 200
        async with Client(daemon.url) as client:
            (task_id,) = await submit(session, daemon, type="sleep", payload={"seconds": 0.3})
            task = await asyncio.wait_for(client.wait(task_id, poll_s=0.2), 20)
            assert task["state"] == "completed"
        assert daemon.log().count("event streams are open, the most a node serves") == 1
    finally:
        for s in held:
            s.close()
    for _ in range(50):  # the daemon sees the streams go as it next writes to them, or reads EOF
        async with session.get(f"{daemon.url}/v1/events", timeout=aiohttp.ClientTimeout(sock_read=2)) as r:
            if r.status == 200:
                break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("streams were not admitted again after the others closed")
