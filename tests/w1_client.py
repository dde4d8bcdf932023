"""The raw /w1 client: one remote worker's calls of the worker protocol over mutual TLS, with a certificate of the
test lab (or none), each body sent as the test wrote it and each answer taken as it came."""

from __future__ import annotations

import http.client
import io
import json
import ssl
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import aiohttp
import anyio

from tidepool.gateway import pki

CALL_TIMEOUT_S = 30.0  # a blocking call's bound on its connection: it keeps a test from hanging


class Answer(NamedTuple):
    """The status and JSON body of a /w1 answer; unpacked, (status, body)."""

    status: int
    body: Any

    @property
    def error(self) -> dict[str, Any]:
        error: dict[str, Any] = self.body["error"]
        return error

    @property
    def code(self) -> str:
        return str(self.error["code"])


def client_context(lab: pki.Lab, worker: str | None) -> ssl.SSLContext:
    """A worker's TLS: it verifies the gateway by the lab's CA and presents its own certificate (None: none)."""
    context = ssl.create_default_context(cafile=str(lab.ca_file))
    if worker is not None:
        issued = lab.workers[worker]
        context.load_cert_chain(issued.cert, issued.key)
    return context


class Remote:
    """One remote worker speaking the raw /w1 protocol at `url` (https://host:port). From the test's event loop
    its calls share one keep-alive TLS session (`post`, `acquire`, `leased`); `call` blocks on a connection of
    its own, for a test that drives daemons in other processes from plain code."""

    def __init__(self, url: str, context: ssl.SSLContext) -> None:
        self.url = url
        self.context = context
        self.streams: list[aiohttp.ClientResponse] = []  # control streams opened, released on close
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The keep-alive session, opened at its first use (in the loop that uses it)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.context))
        return self._session

    async def post(self, path: str, body: Any = None, *, data: bytes | None = None,
                   content_type: str = "application/json") -> Answer:
        raw = io.BytesIO(json.dumps(body).encode() if data is None else data)  # aiohttp warns of large bytes
        try:
            async with self.session.post(self.url + path, data=raw, headers={"Content-Type": content_type}) as r:
                return Answer(r.status, await r.json(content_type=None))
        except aiohttp.ServerDisconnectedError:
            # A revoke closes the worker's connections: a call that raced with the close is sent again on a
            # new one, as a worker does
            raw.seek(0)
            async with self.session.post(self.url + path, data=raw, headers={"Content-Type": content_type}) as r:
                return Answer(r.status, await r.json(content_type=None))

    async def acquire(self, **body: Any) -> Answer:
        return await self.post("/w1/acquire", {"types": ["noop", "sleep"], "max": 1, "wait_s": 0, **body})

    async def leased(self, **body: Any) -> dict[str, Any]:
        """The one lease an acquire must hand out."""
        answer = await self.acquire(**body)
        assert answer.status == 200, answer
        (lease,) = answer.body["tasks"]
        return dict(lease)

    async def close(self) -> None:
        for stream in self.streams:
            stream.release()
        if self._session is not None:
            await self._session.close()

    def call(self, path: str, body: Any) -> Answer:
        """POST `body` as JSON on a connection of its own, blocking until the answer."""
        where = urlsplit(self.url)
        conn = http.client.HTTPSConnection(where.hostname or "", where.port, context=self.context,
                                           timeout=CALL_TIMEOUT_S)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            answer = conn.getresponse()
            raw = answer.read()
            return Answer(answer.status, json.loads(raw) if raw else None)
        finally:
            conn.close()


class ControlReader:
    """A worker's open control stream, read event by event."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def next(self, *, timeout_s: float = 5.0) -> tuple[str, dict[str, Any]] | None:
        """The next event (keep-alive comments skipped); None once the stream ended."""
        name = None
        with anyio.fail_after(timeout_s):
            async for raw in self.response.content:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: ") and name is not None:
                    return name, json.loads(line.removeprefix("data: "))
        return None


async def open_control(remote: Remote) -> ControlReader:
    """The worker's control stream (GET /w1/control), open until the worker is closed."""
    response = await remote.session.get(remote.url + "/w1/control")
    remote.streams.append(response)
    assert response.status == 200, await response.text()
    return ControlReader(response)
