"""Connections to the server: the pool, the deadline of every store call, and driver errors in words.

A server that stops answering (a firewall dropping packets, a dead switch) looks to the driver like a
slow one: nothing fails, nothing comes back. So every store call runs under a client-side deadline,
covering the wait for a pooled connection, a new connection's handshake and the statements; past
it the call is StoreUnavailable, which the API answers 503 and workers retry.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
import asyncpg  # type: ignore[import-untyped, unused-ignore]  # typed when asyncpg-stubs is installed

from ...errors import ConfigError, StoreUnavailable

Conn = Any  # an asyncpg connection; Any types this package alike with and without asyncpg-stubs

# What the driver raises when the server is away or a statement failed: all become StoreUnavailable.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)
SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
CONNECT_TIMEOUT_S = 3.0  # a new connection's handshake, and the longest wait for a pooled one
CALL_TIMEOUT_S = 5.0  # one store call, from asking for a connection to its last statement's answer
ROW_S = 0.001  # more for a call over many rows (a batch submit, a grouped claim): 10 s more for 10,000
log = logging.getLogger("tidepool.store.postgres")


class Connections:
    """The pool of one store (schema), and the dedicated connections it opens beside it."""

    def __init__(self, url: str, *, schema: str | None, max_connections: int, connect_timeout_s: float,
                 call_timeout_s: float) -> None:
        url, url_schema = split_schema(url)
        self.schema = schema or url_schema or "tidepool"
        if not SCHEMA_NAME.fullmatch(self.schema):
            raise ConfigError(f"config: store schema {self.schema!r} is not a plain SQL name (letters, digits, _)")
        self.url = url
        self.channel = channel_for(self.schema)
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.call_timeout_s = call_timeout_s
        parts = urlsplit(url)  # for messages: never the password
        self.where = f"{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path} schema {self.schema}"
        self.settings = {
            "search_path": f'"{self.schema}"',
            "application_name": f"tidepool {self.schema}",
            "tidepool.channel": self.channel,
            "jit": "off",  # JIT costs more than these small statements
        }
        self._pool: Any = None

    async def open(self) -> Any:
        """Create the pool (not yet in use by calls: `start` it once the schema is right)."""
        try:
            return await asyncpg.create_pool(
                self.url,
                min_size=0,  # no floor to restore: during an outage asyncpg would retry it every second
                max_size=self.max_connections,
                timeout=self.connect_timeout_s,
                command_timeout=None,  # every statement runs within its call's deadline instead (see conn)
                server_settings=self.settings,
            )
        except DRIVER_ERRORS as exc:
            raise StoreUnavailable(f"store {self.where}: cannot connect: {said(exc)}") from exc

    def start(self, pool: Any) -> None:
        self._pool = pool

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with anyio.move_on_after(self.call_timeout_s, shield=True):
                await pool.close()
            pool.terminate()  # a no-op after a clean close; ends connections stuck past the timeout

    async def connect(self, role: str) -> Conn:
        """A connection of its own, outside the pool (the LISTEN session)."""
        try:
            return await asyncpg.connect(
                self.url, timeout=self.connect_timeout_s, command_timeout=self.call_timeout_s,
                server_settings={**self.settings, "application_name": f"tidepool {self.schema} {role}"},
            )  # fmt: skip
        except DRIVER_ERRORS as exc:
            raise StoreUnavailable(f"store {self.where}: cannot connect: {said(exc)}") from exc

    @asynccontextmanager
    async def conn(self, *, rows: int = 0) -> AsyncIterator[Conn]:
        """A pooled connection for one store call, which ends within call_timeout_s, and ROW_S more for each
        of the `rows` it writes when they are many; driver errors and the deadline leave as StoreUnavailable
        with the original as cause."""
        if self._pool is None:
            raise StoreUnavailable("the store is not open")
        deadline_s = self.call_timeout_s + rows * ROW_S
        try:
            with anyio.fail_after(deadline_s):
                async with self._pooled(self._pool) as conn:
                    yield conn
        except TimeoutError as exc:
            raise StoreUnavailable(f"store {self.where}: no answer within {deadline_s:g}s: the server or "
                                   "the network is stuck") from exc

    @asynccontextmanager
    async def _pooled(self, pool: Any) -> AsyncIterator[Conn]:
        # A server that accepts and never answers holds every pooled connection: a caller waits for one at
        # most connect_timeout_s, not until a stuck statement gives up.
        try:
            conn = await pool.acquire(timeout=self.connect_timeout_s)
        except TimeoutError as exc:
            raise StoreUnavailable(f"store {self.where}: no connection came free within {self.connect_timeout_s:g}s "
                                   f"(all {self.max_connections} are busy, or stuck on a server that does not "
                                   "answer)") from exc
        except DRIVER_ERRORS as exc:
            raise StoreUnavailable(f"store {self.where}: {said(exc)}") from exc
        try:
            yield conn
        except asyncpg.PostgresError as exc:  # the server answered: the connection serves on
            raise StoreUnavailable(f"store {self.where}: {said(exc)}") from exc
        except (*DRIVER_ERRORS, anyio.get_cancelled_exc_class()) as exc:
            # Broken, or cut off mid-statement by the deadline: of no more use, and giving it back as it
            # is would wait for the server, past the deadline, to reset it.
            conn.terminate()
            if isinstance(exc, DRIVER_ERRORS):
                raise StoreUnavailable(f"store {self.where}: {said(exc)}") from exc
            raise
        finally:
            # Giving it back resets it, a round trip: a server that stopped answering fails that too. It
            # must not replace the caller's answer, nor escape raw: a TimeoutError from here once ended
            # the daemon 40 s into such an outage.
            try:
                await pool.release(conn)
            except DRIVER_ERRORS as exc:
                log.debug("store %s: a connection could not be given back: %s", self.where, said(exc))


def said(exc: BaseException) -> str:
    """What went wrong, in words: a timeout's own text is empty ("TimeoutError: " told a user nothing)."""
    if isinstance(exc, StoreUnavailable):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return f"no answer in time{f' ({exc})' if str(exc) else ''}: the server or the network is stuck"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def channel_for(schema: str) -> str:
    """The NOTIFY channel of a schema: a name of at most 63 bytes, as PostgreSQL requires."""
    channel = f"tidepool.{schema}"
    return channel if len(channel.encode()) <= 63 else f"tidepool.{hashlib.md5(schema.encode()).hexdigest()}"


def split_schema(url: str) -> tuple[str, str | None]:
    """The URL without its `schema` query parameter (asyncpg would send it to the server), and that schema."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schemas = [v for k, v in query if k == "schema"]
    if not schemas:
        return url, None
    rest = urlencode([(k, v) for k, v in query if k != "schema"])
    return urlunsplit(parts._replace(query=rest)), schemas[-1]
