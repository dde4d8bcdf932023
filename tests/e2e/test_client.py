"""tidepool.client.Client against a live daemon: every call, its errors, and the bearer token."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp import web

from tidepool.client import ApiError, Client, InvalidAddress, Unreachable

from .conftest import UNKNOWN_ID, Daemon, free_port


def later(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


@pytest.mark.e2e
async def test_submit_get_wait_and_the_pool(daemon: Daemon) -> None:
    async with Client(daemon.url) as client:
        task = await client.submit("sleep", {"seconds": 1.0}, priority=3, max_attempts=2,
                                   idempotency_key="client-1")
        assert (task["type"], task["priority"], task["max_attempts"], task["state"]) == ("sleep", 3, 2, "pending")
        assert (await client.submit("sleep", {"seconds": 1.0}, priority=3, max_attempts=2,
                                    idempotency_key="client-1"))["id"] == task["id"], "same key, same task"

        seen: list[dict[str, Any]] = []  # the task, again once the stream listens, then each of its events
        final = await client.wait(task["id"], on_change=seen.append)
        assert final["state"] == "completed" and final["attempts"][0]["status"] == "succeeded"
        assert [s["id"] for s in seen[:2]] == [task["id"]] * 2 and "event" not in seen[1]
        events = seen[2:]
        assert {e.get("task_id") for e in events} == {task["id"]}
        ids = [e["id"] for e in events]  # the SSE id field, as the events' data no longer repeats it
        assert all(isinstance(i, int) for i in ids) and ids == sorted(set(ids)), ids
        names = [e["event"] for e in events]
        assert "task.progress" in names and names[-1] == "task.finished", names
        phases = [e["phase"] for e in events if e["event"] == "task.phase"]
        assert phases and ["initialize", "prepare", "run", "stop"][-len(phases):] == phases, "from when it listened"

        got = await client.get(task["id"])
        assert got["id"] == task["id"] and got["state"] == "completed" and "results" in got

        pool = await client.pool()
        assert pool["node_id"] == "e2e-node" and pool["workers"] >= pool["min_workers"]
        assert set(pool["queue"]) >= {"pending", "running", "retry_wait"}


@pytest.mark.e2e
async def test_wait_on_a_running_task_reports_where_it_is_before_its_next_event(daemon: Daemon) -> None:
    async with Client(daemon.url) as client:
        task = await client.submit("sleep", {"seconds": 3.0})
        while (await client.get(task["id"]))["phase"] != "run":
            await asyncio.sleep(0.05)
        seen: list[dict[str, Any]] = []
        waiting = asyncio.create_task(client.wait(task["id"], on_change=seen.append))
        while len(seen) < 2:  # the task as first read, then as read once the stream listens
            await asyncio.sleep(0.01)
        # its next event (progress at 1 s) is not due yet: `submit --wait` shows this read, not "pending"
        assert [(s.get("event"), s["state"], s["phase"]) for s in seen] == [(None, "running", "run")] * 2
        assert (await waiting)["state"] == "completed"


@pytest.mark.e2e
async def test_events_name_the_streams_own_notices_and_end_at_stream_closed(daemon: Daemon) -> None:
    async with Client(daemon.url) as client:
        stream = client.events(last_event_id=1)  # an id this run never gave: the stream says events were missed
        assert await anext(stream) == {"event": "stream.gap", "missed": True}
        assert await anext(stream) == {"event": "stream.connected"}
        await anyio.to_thread.run_sync(daemon.stop)
        rest = [event async for event in stream]
        assert rest[-1] == {"event": "stream.closed", "reason": "shutdown"}
        assert all(isinstance(e["event"], str) for e in rest) and "worker.started" in {e["event"] for e in rest}
        assert all(isinstance(e["id"], int) for e in rest[:-1]), "events have ids; the notices have none"


@pytest.mark.e2e
async def test_wait_raises_unreachable_when_the_daemon_shuts_down_under_it(daemon: Daemon) -> None:
    async with Client(daemon.url) as client:
        task = await client.submit("sleep", {"seconds": 30})

        async def stop_once_running() -> None:
            while (await client.get(task["id"]))["state"] != "running":
                await anyio.sleep(0.05)
            await anyio.to_thread.run_sync(daemon.stop)  # SIGTERM: the stream closes, then the daemon is gone

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_once_running)
            with pytest.raises(Unreachable, match="no tidepool daemon answered"):
                await client.wait(task["id"], poll_s=0.2)


@pytest.mark.e2e
async def test_wait_returns_a_task_that_finished_in_the_drain_though_the_daemon_is_gone_after(
        daemon: Daemon) -> None:
    """systemctl restart: the task ends in the drain, its task.finished arrives, the daemon exits before
    wait() reads the task once more. The ending is known: it is the answer, not Unreachable."""
    async with Client(daemon.url) as client:
        task = await client.submit("sleep", {"seconds": 1.0})  # within the 2 s drain

        async def stop_once_running() -> None:
            while (await client.get(task["id"]))["state"] != "running":
                await anyio.sleep(0.05)
            await anyio.to_thread.run_sync(daemon.stop)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_once_running)
            ended = await client.wait(task["id"])  # was: Unreachable, though task.finished had come
    assert (ended["id"], ended["state"], ended["error"]) == (task["id"], "completed", None)


@pytest.mark.e2e
async def test_submit_many_list_with_filters_and_pages(daemon: Daemon) -> None:
    async with Client(daemon.url) as client:
        held = {"type": "noop", "available_at": later(3600)}
        ids = await client.submit_many([held] * 5)
        done = await client.submit_many([{"type": "noop"}])
        assert len(ids) == 5 and len(set(ids)) == 5
        await client.wait(done[0])

        pages: list[str] = []
        cursor = None
        while True:
            page = await client.list(state="pending", type="noop", limit=2, cursor=cursor)
            assert len(page["tasks"]) <= 2
            pages += [t["id"] for t in page["tasks"]]
            if not (cursor := page["next_cursor"]):
                break
        assert pages == sorted(ids, reverse=True), "newest first, each pending task once across the pages"
        assert [t["id"] for t in (await client.list(state="completed"))["tasks"]] == done
        assert (await client.list(type="sleep"))["tasks"] == []
        assert (await client.list(type="noop&limit=1"))["tasks"] == [], "values are escaped, never parameters"


@pytest.mark.e2e
async def test_cancel_retry_and_the_errors_they_raise(daemon: Daemon) -> None:
    async with Client(daemon.url) as client:
        task = await client.submit("noop", available_at=later(3600))
        assert await client.cancel(task["id"]) == "cancelled"
        assert await client.cancel(task["id"]) == "cancelled", "a repeated cancel is a no-op"
        assert await client.retry(task["id"]) == "pending"
        assert (await client.wait(task["id"]))["state"] == "completed", "retried: runs now"

        waiting = await client.submit("noop", available_at=later(3600))
        errors: dict[str, Any] = {}
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "retry_pending": lambda: client.retry(waiting["id"]), "get_unknown": lambda: client.get(UNKNOWN_ID),
            "bad_type": lambda: client.submit("no-such-type"), "bad_limit": lambda: client.list(limit=100000)}
        for name, call in calls.items():
            with pytest.raises(ApiError) as caught:
                await call()
            errors[name] = (caught.value.status, caught.value.code)
        assert errors == {"retry_pending": (409, "conflict"), "get_unknown": (404, "not_found"),
                          "bad_type": (400, "invalid_request"), "bad_limit": (400, "invalid_request")}

    async with Client(f"http://127.0.0.1:{free_port()}", timeout_s=2) as nobody:
        with pytest.raises(Unreachable, match="no tidepool daemon answered"):
            await nobody.pool()
    for url in ("garbage", "ftp://127.0.0.1:8470", "http://127.0.0.1:99999", "unix:"):
        with pytest.raises(InvalidAddress, match=r"is not an address|names no socket"):
            Client(url)


@pytest.mark.e2e
async def test_the_client_sends_the_bearer_token(make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    (tmp_path / "token").write_text("client-token")
    daemon = make_daemon({"api": {"token_file": str(tmp_path / "token")}})
    daemon.start()
    async with Client(daemon.url, token="client-token") as client:
        task = await client.submit("noop")
        assert (await client.wait(task["id"]))["state"] == "completed"
    async with Client(daemon.url, token="wrong") as client:
        with pytest.raises(ApiError) as caught:
            await client.pool()
        assert (caught.value.status, caught.value.code) == (401, "unauthorized")


@pytest.mark.e2e
async def test_someone_elses_event_stream_at_the_address_is_unreachable_at_once_not_read_for_ever() -> None:
    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while True:
            await response.write(b"data: {}\n\n")
            await asyncio.sleep(0.05)

    app = web.Application()
    app.router.add_get("/v1/events", endless)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with Client(f"http://127.0.0.1:{port}") as client:
            with anyio.fail_after(5), pytest.raises(Unreachable, match="not tidepool's"):
                async for _ in client.events():
                    pass
    finally:
        await runner.cleanup()
