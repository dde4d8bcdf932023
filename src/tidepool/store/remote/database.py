"""A remote worker's database, which is its gateway: one HTTPS session with it, a keep-alive connection
pool that presents the worker's client certificate and verifies the gateway's, JSON in and out, the
gateway's refusals turned into the project's errors, and the task JSON it hands out read back.

Nothing of the queue is kept on this host: every write goes to the gateway, which keeps it in its store."""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import anyio

from ... import __version__
from ...backoff import Backoff
from ...errors import ConfigError, StoreError, StoreUnavailable, ValueRefused
from ...logs import Outage
from ...model import Phase, State, Task, TaskError

log = logging.getLogger("tidepool.remote")
CONNECT_TIMEOUT_S = 5.0  # a gateway that does not complete a TLS handshake in this long is away
REQUEST_TIMEOUT_S = 10.0  # a renewal, phase note or ending not answered in this long is tried again
# Tries again after a failure: 0.5 s doubling to 15 s, each wait drawn from its upper half, so that the
# workers of a restarted gateway do not all come back in the same instant.
RECONNECT = Backoff(first_s=0.5, cap_s=15.0, jitter=0.5)


class Refusal(StoreError):
    """The gateway's registry refuses this worker: `code` is worker_pending or worker_revoked."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: Any

    def error_code(self) -> str:
        error = self.body.get("error") if isinstance(self.body, dict) else None
        return str(error.get("code", "")) if isinstance(error, dict) else ""

    def error_message(self) -> str:
        error = self.body.get("error") if isinstance(self.body, dict) else None
        return str(error.get("message", "")) if isinstance(error, dict) else repr(self.body)[:200]


def client_tls(*, cert_file: str, key_file: str, ca_file: str) -> ssl.SSLContext:
    """The TLS context of a remote worker: its certificate and key, the gateway verified by ca_file (else by
    the system's CAs). A file that is missing or unreadable is a config error naming its key."""
    for key, path in (("cert_file", cert_file), ("key_file", key_file), ("ca_file", ca_file)):
        if path and not Path(path).is_file():
            raise ConfigError(f"config: store.{key}: {path} does not exist or is not a file")
    try:
        context = ssl.create_default_context(cafile=ca_file or None)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"config: store.ca_file: cannot load {ca_file}: {exc}") from None
    try:
        context.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"config: store.cert_file, store.key_file: cannot load the client certificate "
                          f"{cert_file} with key {key_file}: {exc}") from None
    return context


class Wire:
    """POSTs and the control stream's GET to one gateway. Not connected until open(); nothing is sent then."""

    def __init__(self, url: str, tls: ssl.SSLContext) -> None:
        self.url = url.rstrip("/")
        self.tls = tls  # each request's: replaced (a rotated certificate), new connections present the new one
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0)
        self._session = aiohttp.ClientSession(connector=connector, headers={"User-Agent": f"tidepool/{__version__}"},
                                              json_serialize=_compact)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise StoreUnavailable(f"gateway {self.url}: not connected (the store is not open)")
        return self._session

    async def post(self, path: str, body: dict[str, Any], *, timeout_s: float) -> Answer:
        """The gateway's answer to one POST. StoreUnavailable when it did not answer (or answered 5xx: it
        could not reach its store), Refusal on its registry's 403; every other status is returned."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=CONNECT_TIMEOUT_S)
        try:
            async with self.session().post(self.url + path, json=body, timeout=timeout, ssl=self.tls) as response:
                raw = await response.read()
                status = response.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise StoreUnavailable(f"gateway {self.url} did not answer {path}: {reason(exc)}") from None
        except UnicodeError as exc:  # a value no JSON body can carry (the port makes text storable first)
            raise ValueRefused(f"{path}: a value cannot be sent to the gateway: {exc}") from exc
        return checked(Answer(status, parse_json(raw)), path, self.url)

    def get_stream(self, path: str, *, idle_s: float) -> Any:
        """The response of a GET that streams (the control stream): a context manager; a read waits at most
        idle_s for the next bytes."""
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=idle_s)
        return self.session().get(self.url + path, timeout=timeout, headers={"Accept": "text/event-stream"},
                                  ssl=self.tls)


class Calls:
    """The adapter's calls of the gateway: whether it answered the last one (for the readiness probe), its
    outages said once each, a call tried again while it restarts, and answers read as the protocol's."""

    def __init__(self, wire: Wire, monotonic: Callable[[], float]) -> None:
        self._wire = wire
        self._monotonic = monotonic
        self._away = Outage(log)
        self.gone: str | None = None  # why the gateway did not answer the last call, if it did not

    async def post(self, path: str, body: dict[str, Any], *, timeout_s: float) -> Answer:
        try:
            answer = await self._wire.post(path, body, timeout_s=timeout_s)
        except StoreUnavailable as exc:
            self.failed(exc)
            raise
        self.answered()
        return answer

    def failed(self, exc: StoreUnavailable) -> None:
        """The gateway did not answer a call: said once for the outage, and by the readiness probe."""
        self.gone = str(exc)
        self._away.failing("%s; trying again with backoff", exc)

    def answered(self) -> None:
        self.gone = None
        self._away.over("gateway %s answers again", self._wire.url)

    async def post_within(self, path: str, body: dict[str, Any], *, budget_s: float) -> Answer:
        """A write answered 200, tried again with backoff while the gateway is away (a restart), for at most
        budget_s; the last StoreUnavailable then (ValueRefused at once: a refused body is not tried again)."""
        give_up_at = self._monotonic() + budget_s
        for wait_s in RECONNECT.delays():
            left_s = give_up_at - self._monotonic()
            try:
                return self.written(await self.post(path, body, timeout_s=max(1.0, min(REQUEST_TIMEOUT_S, left_s))))
            except StoreUnavailable:
                if self._monotonic() + wait_s >= give_up_at:
                    raise
            await anyio.sleep(wait_s)
        raise AssertionError("RECONNECT has no end")

    def written(self, answer: Answer) -> Answer:
        """A write's answer, as ok(); a body the gateway refused (400, 422) is ValueRefused: sent again, it would
        be refused again, so no caller may take it for the gateway being away."""
        if answer.status in (400, 422):
            raise ValueRefused(f"gateway {self._wire.url} refused the request ({answer.status} {answer.error_code()}): "
                               f"{answer.error_message()}")
        return self.ok(answer)

    def ok(self, answer: Answer) -> Answer:
        if answer.status != 200 or not isinstance(answer.body, dict):
            raise StoreUnavailable(f"gateway {self._wire.url}: unexpected answer {answer.status}: "
                                   f"{answer.error_message()}")
        return answer

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[None]:
        """An answer of another shape than the protocol's (not the gateway's, or a version it is not) is the
        gateway's not answering: StoreUnavailable, which every caller of the port expects and retries."""
        try:
            yield
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StoreUnavailable(f"gateway {self._wire.url}: its answer to {path} is not the protocol's: "
                                   f"{type(exc).__name__}: {exc}") from None


def checked(answer: Answer, path: str, url: str) -> Answer:
    if answer.status == 403 and answer.error_code().startswith("worker_"):
        raise Refusal(answer.error_code(), answer.error_message())
    if answer.status == ValueRefused.http_status and answer.error_code() == ValueRefused.code:
        raise ValueRefused(f"gateway {url} refused a value of {path}: {answer.error_message()}")
    if answer.status >= 500 or answer.status == 429:
        raise StoreUnavailable(f"gateway {url} answered {path} with {answer.status}: {answer.error_message()}")
    return answer


def reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return {"error": {"code": "not_json", "message": raw[:200].decode(errors="replace")}}


def instant(text: Any) -> float:
    """An RFC 3339 time of the gateway's JSON (a number is taken as epoch seconds) as epoch seconds."""
    if isinstance(text, int | float):
        return float(text)
    return datetime.fromisoformat(str(text)).timestamp()


def task_of(data: dict[str, Any]) -> Task:
    """The task JSON of an acquire's answer as the engine runs it. Its attempts and results are not read:
    the engine needs neither, and they are the gateway's to keep."""
    error = data.get("error")
    return Task(
        id=data["id"], type=data["type"], payload=data.get("payload") or {}, priority=int(data.get("priority", 0)),
        state=State(data["state"]), phase=Phase(data["phase"]) if data.get("phase") else None,
        progress=data.get("progress"), attempt=int(data.get("attempt", 1)),
        max_attempts=int(data.get("max_attempts", 1)), interruptions=int(data.get("interruptions", 0)),
        timeout_s=data.get("timeout_s"), required_tags=tuple(data.get("required_tags") or ()),
        idempotency_key=data.get("idempotency_key"), node_id=data.get("node_id"),
        error=TaskError(error["code"], error["message"]) if isinstance(error, dict) else None,
        created_at=instant(data["created_at"]), updated_at=instant(data["updated_at"]),
        available_at=instant(data["available_at"]),
        finished_at=instant(data["finished_at"]) if data.get("finished_at") else None,
        inputs={str(name): str(sha) for name, sha in (data.get("inputs") or {}).items()})
