"""A small async client of the tidepool HTTP API, for producers and the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO
from urllib.parse import quote, urlencode

import aiohttp
from yarl import URL

TERMINAL = frozenset({"completed", "failed", "timed_out", "cancelled"})
CHUNK_BYTES = 1 << 20  # files go up and come down in pieces of this, never whole in memory
# A transfer may take as long as it takes, but never sits silent for longer than this.
TRANSFER_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=60)
# Every answer of a daemon carries it: what tells a daemon's answer from a proxy's or another service's
# on the port, whose JSON would otherwise be read as the daemon's.
API_HEADER = ("Tidepool-API", "v1")


Artifacts = list[dict[str, Any]]  # named here: within Client, `list` is a method


class ApiError(Exception):
    """The daemon answered with an error."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class Unreachable(Exception):
    """No daemon answered at the address."""


_NOT_JSON = object()


class InvalidAddress(ValueError):
    """The address is neither http(s)://host[:port] nor unix:/path."""


class Client:
    """`async with Client("http://127.0.0.1:8470") as c: task = await c.submit("sleep", {"seconds": 1})`.

    A unix socket is given as "unix:/run/tidepool/api.sock".
    """

    def __init__(self, url: str = "http://127.0.0.1:8470", *, token: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.url = url
        _check_address(url)
        connector = None
        if url.startswith("unix:"):
            connector = aiohttp.UnixConnector(path=url.removeprefix("unix:"))
            self._base = "http://localhost"
        else:
            self._base = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session = aiohttp.ClientSession(connector=connector, headers=headers,
                                              timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            async with self._session.request(method, self._base + path, json=body) as response:
                return self._answer(response, await response.read())
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise Unreachable(f"no tidepool daemon answered at {self.url}: {_reason(exc)}") from None

    def _answer(self, response: aiohttp.ClientResponse, body: bytes) -> Any:
        """The JSON the daemon answered, or its error as ApiError. What is not a tidepool daemon's answer (a
        proxy's 502 page while the daemon behind it is down, another service on the port) is Unreachable:
        no daemon answered, and a caller must not take it for a refusal of the request."""
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = _NOT_JSON
        error = data.get("error") if isinstance(data, dict) else None
        if response.status >= 400 and isinstance(error, dict):
            raise ApiError(response.status, str(error.get("code", "error")), str(error.get("message", "")))
        if response.status >= 400 or data is _NOT_JSON or response.headers.get(API_HEADER[0]) != API_HEADER[1]:
            raise Unreachable(f"no tidepool daemon answered at {self.url}: it answered {response.status} "
                              f"{response.reason or ''}".rstrip() + ", not as tidepool does (a proxy whose daemon "
                              "is down, or another service)")
        return data

    async def submit(self, type: str, payload: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
        body = {"type": type, "payload": payload or {}, **{k: v for k, v in options.items() if v is not None}}
        task: dict[str, Any] = await self.request("POST", "/v1/tasks", body)
        return task

    async def submit_many(self, tasks: Sequence[dict[str, Any]]) -> list[str]:
        ids: list[str] = (await self.request("POST", "/v1/tasks/batch", {"tasks": list(tasks)}))["ids"]
        return ids

    async def get(self, task_id: str) -> dict[str, Any]:
        task: dict[str, Any] = await self.request("GET", f"/v1/tasks/{_segment(task_id)}")
        return task

    async def list(self, *, state: str | None = None, type: str | None = None, limit: int = 50,
                   cursor: str | None = None, organization: str | None = None) -> dict[str, Any]:
        query = urlencode([(k, v) for k, v in (("state", state), ("type", type), ("limit", limit),
                                               ("cursor", cursor), ("organization", organization)) if v is not None])
        page: dict[str, Any] = await self.request("GET", f"/v1/tasks?{query}")
        return page

    async def cancel(self, task_id: str) -> str:
        state: str = (await self.request("POST", f"/v1/tasks/{_segment(task_id)}/cancel"))["state"]
        return state

    async def retry(self, task_id: str) -> str:
        state: str = (await self.request("POST", f"/v1/tasks/{_segment(task_id)}/retry"))["state"]
        return state

    async def upload(self, path: Path, *, sha256: str | None = None,
                     on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Upload the file at `path` as a blob, streamed: {sha256, size}. With `sha256` (the file's, as the caller
        computed it) the daemon stores nothing unless the bytes it got have that digest. `on_bytes` hears each
        piece's length as it is sent."""
        headers = {"Content-Type": "application/octet-stream", **({"X-Content-SHA256": sha256} if sha256 else {})}
        with path.open("rb") as file:  # opened first: a file that cannot be read is the caller's OSError
            try:
                async with self._session.post(self._base + "/v1/blobs", data=_pieces(file, on_bytes),
                                              headers=headers, timeout=TRANSFER_TIMEOUT) as response:
                    blob: dict[str, Any] = self._answer(response, await response.read())
                    return blob
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
                raise Unreachable(f"no tidepool daemon answered at {self.url}: {_reason(exc)}") from None

    async def artifacts(self, task_id: str) -> Artifacts:
        """The task's artifacts, every attempt's, oldest first."""
        listed: Artifacts = (await self.request("GET", f"/v1/tasks/{_segment(task_id)}/artifacts"))["artifacts"]
        return listed

    async def download(self, path: str, write: Callable[[bytes], object]) -> int:
        """GET `path` (a blob's or an artifact's route), each piece of its body handed to `write` as it comes (never
        the whole in memory): how many bytes came."""
        came = 0
        try:
            async with self._session.get(self._base + path, timeout=TRANSFER_TIMEOUT) as response:
                if response.status >= 400 or response.headers.get(API_HEADER[0]) != API_HEADER[1]:
                    self._answer(response, await response.read())  # ApiError or Unreachable, as it is
                async for piece in response.content.iter_chunked(CHUNK_BYTES):
                    write(piece)
                    came += len(piece)
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise Unreachable(f"no tidepool daemon answered at {self.url}: {_reason(exc)}") from None
        return came

    async def submit_scan(self, profile: str, payload: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
        """Start a scan of `profile`; options: priority, organization, idempotency_key."""
        body = {"profile": profile, "payload": payload or {}, **{k: v for k, v in options.items() if v is not None}}
        scan: dict[str, Any] = await self.request("POST", "/v1/scans", body)
        return scan

    async def get_scan(self, scan_id: str) -> dict[str, Any]:
        scan: dict[str, Any] = await self.request("GET", f"/v1/scans/{_segment(scan_id)}")
        return scan

    async def list_scans(self, *, state: str | None = None, profile: str | None = None, limit: int = 50,
                         cursor: str | None = None) -> dict[str, Any]:
        query = urlencode([(k, v) for k, v in (("state", state), ("profile", profile), ("limit", limit),
                                               ("cursor", cursor)) if v is not None])
        page: dict[str, Any] = await self.request("GET", f"/v1/scans?{query}")
        return page

    async def cancel_scan(self, scan_id: str) -> str:
        state: str = (await self.request("POST", f"/v1/scans/{_segment(scan_id)}/cancel"))["state"]
        return state

    async def retry_job(self, scan_id: str, index: int) -> dict[str, Any]:
        scan: dict[str, Any] = await self.request("POST", f"/v1/scans/{_segment(scan_id)}/jobs/{index}/retry")
        return scan

    async def pool(self) -> dict[str, Any]:
        pool: dict[str, Any] = await self.request("GET", "/v1/pool")
        return pool

    async def events(self, *, task_id: str | None = None, types: str | None = None,
                     last_event_id: int | None = None) -> AsyncIterator[dict[str, Any]]:
        """Follow GET /v1/events: each event's JSON data with its SSE name under "event" and its id under "id",
        as it happens.

        The stream's own notices come as well: stream.connected (from here on nothing is missed),
        stream.gap (events were missed) and stream.closed (the daemon ended the stream: this one ends)."""
        query = urlencode([(k, v) for k, v in (("task_id", task_id), ("type", types)) if v])
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
        try:
            async with self._session.get(f"{self._base}/v1/events?{query}", headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=None, sock_read=60)) as response:
                if response.status >= 400 or response.content_type != "text/event-stream":
                    self._answer(response, await response.read())  # ApiError or Unreachable, as it is
                    raise Unreachable(f"no tidepool daemon answered at {self.url}: GET /v1/events answered "
                                      f"{response.content_type}, not an event stream")
                if response.headers.get(API_HEADER[0]) != API_HEADER[1]:  # someone's stream: never read to its end
                    raise Unreachable(f"no tidepool daemon answered at {self.url}: the event stream there is "
                                      "not tidepool's")
                async with contextlib.aclosing(_parsed(response.content)) as parsed:
                    async for event in parsed:
                        yield event
                        if event["event"] == "stream.closed":
                            return
        except aiohttp.ClientConnectorError as exc:  # no connection at all: nobody is there
            raise Unreachable(f"no tidepool daemon answered at {self.url}: {_reason(exc)}") from None
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise Unreachable(f"event stream from {self.url} broke: {_reason(exc)}") from None

    async def wait(self, task_id: str, *, on_change: Callable[[dict[str, Any]], None] | None = None,
                   poll_s: float = 2.0) -> dict[str, Any]:
        """Until the task is terminal, following its events; on_change sees the task and each event.

        A daemon streams the events of its own node: a task that another node of a fleet runs sends
        none here after it was created. So a stream silent for `poll_s` * 2.5 is closed and the task read
        again. A stream the daemon closed (shutdown) is followed by a re-read too: Unreachable once the
        daemon is gone, unless the task's task.finished came first (a restart right after the drain): then
        the last task read, with the state, error and time that event told. A daemon serving all the
        streams it can is polled every `poll_s` instead."""
        task = await self.get(task_id)
        if on_change is not None:
            on_change(task)
        ended: dict[str, Any] | None = None
        silence_s = poll_s * 2.5
        while task["state"] not in TERMINAL:
            if ended is not None and ended["event"] == "stream.closed":  # a daemon shutting down closes each
                await asyncio.sleep(poll_s)                                # new stream at once: do not spin
            ended = None
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(silence_s) as silence:
                    try:
                        ended = await self._follow(task_id, silence, silence_s, on_change)
                    except ApiError as exc:
                        if exc.code != "too_many_streams":
                            raise
                        ended = {"event": "stream.closed"}
            try:
                task = await self.get(task_id)
            except Unreachable:
                if ended is None or ended["event"] != "task.finished":
                    raise
                # It finished (its event came), and the daemon went away before the read, as a restart
                # does right after a drain: the ending is known, and is the answer, said as told by the event.
                return {**task, "state": ended["state"], "error": ended["error"], "phase": None,
                        "finished_at": ended.get("ts"), "updated_at": ended.get("ts")}
        return task

    async def _follow(self, task_id: str, silence: asyncio.Timeout, silence_s: float,
                      on_change: Callable[[dict[str, Any]], None] | None) -> dict[str, Any] | None:
        """wait()'s reading of one stream, until the task finishes or the stream ends: the task.finished
        or stream.closed event that ended it, or None."""
        async for event in self.events(task_id=task_id):
            silence.reschedule(asyncio.get_running_loop().time() + silence_s)
            if event["event"] == "stream.connected":  # what happened before we listened
                task = await self.get(task_id)
                if on_change is not None:
                    on_change(task)
                if task["state"] in TERMINAL:
                    return None
                continue
            if on_change is not None:
                on_change(event)
            if event["event"] in ("task.finished", "stream.closed"):
                return event
        return None


async def _parsed(lines: AsyncIterable[bytes]) -> AsyncGenerator[dict[str, Any], None]:
    """The events of an SSE body: each one's JSON data, with its name (the `event:` field) under "event"
    and, for an event of the bus, its id (the `id:` field) under "id"; the `: connected` comment as the
    notice stream.connected."""
    event_id, name, data = None, "message", []
    async for raw in lines:
        line = raw.decode().rstrip("\r\n")
        if line == ": connected":  # from here on no event of ours can be missed
            yield {"event": "stream.connected"}
        elif line.startswith("id:"):  # the stream's own notices have none
            event_id = int(line[3:].strip())
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line:
            if data:
                fields = {"event": name} if event_id is None else {"id": event_id, "event": name}
                yield {**json.loads("\n".join(data)), **fields}
            event_id, name, data = None, "message", []


async def _pieces(file: BinaryIO, on_bytes: Callable[[int], None] | None) -> AsyncIterator[bytes]:
    """The file's bytes, a piece at a time (a read of one piece is quick enough not to matter to the loop)."""
    while piece := file.read(CHUNK_BYTES):
        yield piece
        if on_bytes is not None:
            on_bytes(len(piece))


def _reason(exc: BaseException) -> str:
    """What went wrong, in words: a timeout's own text is empty, and a refused connection's is aiohttp's
    ("Cannot connect to host … ssl:default [Connect call failed …]"), which says the address twice."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return "no answer in time (a daemon whose event loop is held up by blocking work answers nothing)"
    if isinstance(exc, aiohttp.ClientConnectorError):
        code, cause = exc.os_error.errno, exc.os_error  # a resolver's failure has its own negative codes
        return f"cannot connect: {os.strerror(code) if code is not None and code > 0 else cause.strerror or cause}"
    return str(exc) or type(exc).__name__


def _segment(task_id: str) -> str:
    """A task id as one path segment: `../pool` or `x?y` must not become another route or a query."""
    return quote(task_id, safe="")


def _check_address(url: str) -> None:
    if url.startswith("unix:"):
        if not url.removeprefix("unix:"):
            raise InvalidAddress(f"{url!r} names no socket: use unix:/path/to/api.sock")
        return
    try:
        parts = URL(url)
    except ValueError as exc:
        raise InvalidAddress(f"{url!r} is not an address ({exc}): use http://host:port or unix:/path") from None
    if parts.scheme not in ("http", "https") or not parts.host:
        raise InvalidAddress(f"{url!r} is not an address: use http://host:port or unix:/path")
