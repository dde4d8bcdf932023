"""What the API tests share beyond conftest.py: HTTP with any headers, store counts, an SSE reader.

Not a conftest: test modules import it. The daemon fixtures themselves come from conftest.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from .conftest import Daemon, Response


def call(daemon: Daemon, method: str, path: str, body: Any = None, *, data: bytes | None = None,
         headers: dict[str, str] | None = None, content_type: str | None = "application/json",
         timeout_s: float = 10.0) -> Response:
    """One request with exactly the headers the test gives (no token is added for it)."""
    return daemon.request(method, path, body, data=data, headers=dict(headers or {}), content_type=content_type,
                          timeout_s=timeout_s)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def store_counts(daemon: Daemon, *, headers: dict[str, str] | None = None) -> tuple[int, dict[str, int]]:
    """(tasks listed by GET /v1/tasks, the pool's queue by state): what a bad request must leave alone."""
    listed = call(daemon, "GET", "/v1/tasks?limit=1000", headers=headers)
    pool = call(daemon, "GET", "/v1/pool", headers=headers)
    assert listed.status == 200 and pool.status == 200, (listed, pool)
    return len(listed.body["tasks"]), pool.body["queue"]


@dataclass(frozen=True)
class Sse:
    """One server-sent event: `id` is None on the stream's own notices (stream.gap, stream.closed)."""

    event: str
    data: dict[str, Any]
    id: int | None

    @property
    def task_id(self) -> str | None:
        task_id: str | None = self.data.get("task_id")
        return task_id


class EventStream:
    """Reads GET /v1/events frame by frame; a timed-out read leaves the parser's state intact."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.comments: list[str] = []
        self.pending: list[Sse] = []  # events read before the `: connected` comment (a stream.gap)
        self._lines: list[str] = []

    @classmethod
    async def open(cls, session: aiohttp.ClientSession, daemon: Daemon, *, last_id: int | None = None,
                   headers: dict[str, str] | None = None, **params: str) -> EventStream:
        """Connect and wait for the server's `: connected` comment, so later events cannot be missed."""
        sent = dict(headers or {})
        if last_id is not None:
            sent["Last-Event-ID"] = str(last_id)
        response = await session.get(f"{daemon.url}/v1/events", params=params, headers=sent,
                                     timeout=aiohttp.ClientTimeout(total=None, sock_read=None))
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/event-stream")
        stream = cls(response)
        async with asyncio.timeout(10.0):
            while "connected" not in stream.comments:
                event = await stream._block()
                if event is not None:
                    stream.pending.append(event)
        return stream

    async def next(self, *, timeout_s: float = 10.0) -> Sse:
        """The next event (comments are collected in `comments`); EOFError when the stream ends."""
        if self.pending:
            return self.pending.pop(0)
        async with asyncio.timeout(timeout_s):
            while (event := await self._block()) is None:
                pass
            return event

    async def _block(self) -> Sse | None:
        """Lines up to the next blank line: an event, or None for a block of comments."""
        while True:
            raw = await self.response.content.readline()
            if not raw:
                raise EOFError("the event stream ended")
            line = raw.decode().rstrip("\r\n")
            if line:
                self._lines.append(line)
                continue
            lines, self._lines = self._lines, []
            return _parse(lines, self.comments)

    async def until(self, done: Callable[[Sse], bool], *, timeout_s: float = 20.0) -> list[Sse]:
        """Every event up to and including the first one `done` accepts."""
        seen: list[Sse] = []
        async with asyncio.timeout(timeout_s):
            while True:
                seen.append(await self.next(timeout_s=timeout_s))
                if done(seen[-1]):
                    return seen

    def close(self) -> None:
        self.response.close()


def _parse(lines: list[str], comments: list[str]) -> Sse | None:
    fields: dict[str, str] = {}
    for line in lines:
        if line.startswith(":"):
            comments.append(line[1:].strip())
            continue
        name, _, value = line.partition(":")
        fields[name] = value.removeprefix(" ")
    if "event" not in fields:
        return None
    return Sse(fields["event"], json.loads(fields.get("data") or "{}"),
               int(fields["id"]) if "id" in fields else None)


# The events of one noop task, in the order the engine promises them.
NOOP_EVENTS = ["task.created", "task.leased", "task.phase:initialize", "task.phase:prepare", "task.phase:run",
               "plugin.started", "plugin.finished", "task.phase:stop", "task.finished"]


def shape(events: list[Sse]) -> list[str]:
    """Event names, with the phase for task.phase: comparable to NOOP_EVENTS."""
    return [f"{e.event}:{e.data['phase']}" if e.event == "task.phase" else e.event for e in events]


# Requests with a NUL character (%00) in a path or filter: refused as bad input, naming what holds it.
NUL_REQUESTS = [("GET", "/v1/tasks/a%00b", "path"), ("POST", "/v1/tasks/a%00b/cancel", "path"),
                ("GET", "/v1/tasks?type=a%00b", "type"), ("GET", "/v1/events?task_id=a%00b", "task_id"),
                ("DELETE", "/v1/schedules/a%00b", "path")]
