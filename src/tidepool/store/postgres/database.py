"""The database: the PostgreSQL server of a store, and the plumbing every call to it goes through.

Here are the pool and the deadline of every call, driver errors in words, the node's dedicated session
(its node lock and LISTEN), group commit, and the schema's migrations. It is one piece because every part
is how this adapter reaches the server, used alike by the module of each noun; none holds a noun's verbs.

A server that stops answering (a firewall dropping packets, a dead switch) looks to the driver like a
slow one: nothing fails, nothing comes back. So every store call runs under a client-side deadline,
covering the wait for a pooled connection, a new connection's handshake and the statements; past
it the call is StoreUnavailable, which the API answers 503 and workers retry.

Every write that makes tasks claimable (a submit, a retry promotion, an interrupted attempt back to
pending, a schedule firing) sends NOTIFY on the schema's channel, delivered at commit; each node
LISTENs on its session, re-established with backoff after a drop, and pings it so that a silent
network drop is noticed. The node lock goes with the session: after a reconnect it is taken again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
import asyncpg  # type: ignore[import-untyped, unused-ignore]  # typed when asyncpg-stubs is installed
from anyio.abc import TaskStatus

from ...backoff import Backoff
from ...errors import ConfigError, SchemaMismatch, StoreUnavailable, ValueRefused
from .. import sql
from ..port import Node
from ..rows import node_of

Conn = Any  # an asyncpg connection; Any types this package alike with and without asyncpg-stubs

# What the driver raises when the server is away or a statement failed: all become StoreUnavailable.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)
# What the driver raises when the server (or asyncpg's own encoder) refuses a value: text it cannot encode, a
# number past a column's range. Written again it would be refused again: ValueRefused, never an outage.
VALUE_ERRORS: tuple[type[BaseException], ...] = (asyncpg.DataError, UnicodeError, OverflowError)
SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
CONNECT_TIMEOUT_S = 3.0  # a new connection's handshake, and the longest wait for a pooled one
CALL_TIMEOUT_S = 5.0  # one store call, from asking for a connection to its last statement's answer
ROW_S = 0.001  # more for a call over many rows (a batch submit, a grouped claim): 10 s more for 10,000
MIGRATIONS = sql.migrations(__package__)
MIGRATE_TIMEOUT_S = 60.0  # a migration may rewrite a big table: it runs once, at open, not as a store call
MIGRATE_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"
FLEET = sql.queries(__package__, "upkeep.sql")  # the server's state and the node lock are the fleet's statements
SESSION_ERRORS: tuple[type[BaseException], ...] = (StoreUnavailable, *DRIVER_ERRORS)
PING_EVERY_S = 5.0  # the LISTEN connection proves itself this often: a silent network drop is noticed
RECONNECT = Backoff(first_s=0.1, cap_s=5.0)  # between attempts to re-establish the LISTEN connection
MAX_WAKE = 1000  # a notification's count is a hint; no more wake-ups than this from one
MAX_GROUP = 256  # calls per grouped statement
# Uploads that hold a connection of their own at once; a further one waits for a place, so a burst of uploads
# never takes the server's connections from the pools of the fleet's nodes.
UPLOADS_AT_ONCE = 8
log = logging.getLogger("tidepool.store.postgres")


class Database:
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
        self.uploads = asyncio.Semaphore(UPLOADS_AT_ONCE)

    async def open(self, *, migrate: bool, to: int, functions: Sequence[str]) -> int:
        """Create the pool and bring the schema to version `to` (when `migrate`), redefining `functions` after
        the migrations; return the version it had. Calls are served only once the schema is right."""
        pool = await self._create_pool()
        try:
            with anyio.fail_after(MIGRATE_TIMEOUT_S):
                async with pool.acquire() as conn:
                    found = await _migrate(conn, self.schema, to=to, allowed=migrate, where=self.where,
                                           functions=functions)
        except DRIVER_ERRORS as exc:
            pool.terminate()
            raise StoreUnavailable(f"store {self.where}: {said(exc)}") from exc
        except BaseException:
            pool.terminate()
            raise
        self._pool = pool
        return found

    async def _create_pool(self) -> Any:
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

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with anyio.move_on_after(self.call_timeout_s, shield=True):
                await pool.close()
            pool.terminate()  # a no-op after a clean close; ends connections stuck past the timeout

    async def write_failure(self) -> str | None:
        """Asked of the server: a failover that left the URL on a standby, or a database set read-only,
        answers every read and refuses every write. A server that does not answer raises, as any read."""
        async with self.conn() as conn:
            row = await conn.fetchrow(FLEET["takes_writes"])
        if row[0] or row[1] == "on":
            why = "is a standby in recovery" if row[0] else "runs its transactions read-only"
            return f"store {self.where}: the server {why}, so every write is refused"
        return None

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
        except VALUE_ERRORS as exc:  # the server answered (or the value never left): the connection serves on
            raise ValueRefused(f"store {self.where} refused a value: {said(exc)}") from exc
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
    if isinstance(exc, StoreUnavailable | ValueRefused):
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


# the schema: its version, and the numbered migrations of sql/ that bring it to this tidepool's


async def _migrate(conn: Conn, schema: str, *, to: int, allowed: bool, where: str, functions: Sequence[str]) -> int:
    """Bring the schema to version `to` (when `allowed`), then redefine `functions`; return the version it had.
    SchemaMismatch when it is newer, or older and not `allowed`."""
    async with conn.transaction():
        if allowed:  # nodes starting together: the first creates, the others wait and find it current
            await conn.execute(MIGRATE_LOCK, f"tidepool.migrate.{schema}")
        version = await _schema_version(conn, schema)
        if version > to:
            raise SchemaMismatch(f"store {where} has schema version {version}, newer than this tidepool "
                                 f"understands ({to}): upgrade tidepool")
        if version == to:
            return version
        if not allowed:
            raise SchemaMismatch(f"store {where} has schema version {version}, needs {to}: run `tidepool migrate`")
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(f'SET LOCAL search_path TO "{schema}"')  # what the migrations create goes there
        for v, script in (m for m in MIGRATIONS if version < m[0] <= to):
            await conn.execute(script)
            await conn.execute("INSERT INTO schema_version VALUES ($1, extract(epoch FROM clock_timestamp()))", v)
        for function in functions:
            await conn.execute(function)
    return version


async def _schema_version(conn: Conn, schema: str) -> int:
    if await conn.fetchval("SELECT to_regclass($1)", f'"{schema}".schema_version') is None:
        return 0
    return int(await conn.fetchval(f'SELECT coalesce(max(version), 0) FROM "{schema}".schema_version'))


# group commit: calls that queue up while one statement is in flight go out together in the next

I = TypeVar("I")  # noqa: E741  # an item queued for a grouped write
R = TypeVar("R")


class Group(Generic[I, R]):
    """Many callers' writes of one kind, sent as one statement per batch.

    A short-lived flusher task, owned here and awaited by drain(), sends the statements, so a caller
    cancelled mid-write cannot abort the write of the others (asyncio's own cancellation passes
    through anyio's shield). Each caller gets its own result; a failed statement gives each its own
    StoreUnavailable.
    """

    def __init__(self, run: Callable[[list[I]], Awaitable[list[R]]]) -> None:
        self._run = run
        self._queue: deque[tuple[I, asyncio.Future[R]]] = deque()
        self._flusher: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        return self._flusher is not None

    async def __call__(self, item: I) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._queue.append((item, future))
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush(), name="tidepool-postgres-group")
        return await future

    async def drain(self) -> None:
        """Wait until the calls already queued have been written."""
        if self._flusher is not None:
            await asyncio.wait([self._flusher])

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch: list[tuple[I, asyncio.Future[R]]] = []
                while self._queue and len(batch) < MAX_GROUP:
                    item, future = self._queue.popleft()
                    if not future.done():  # a caller cancelled while it waited is not written
                        batch.append((item, future))
                if batch:
                    await self._send(batch)
        finally:
            self._flusher = None
            while self._queue:  # left only when the flusher itself was cancelled (loop shutdown)
                _, future = self._queue.popleft()
                if not future.done():
                    future.set_exception(StoreUnavailable("the store shut down before this write was sent"))

    async def _send(self, batch: list[tuple[I, asyncio.Future[R]]]) -> None:
        try:
            results = await self._run([item for item, _ in batch])
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    kind = ValueRefused if isinstance(exc, ValueRefused) else StoreUnavailable
                    error = kind(f"grouped write failed: {said(exc)}")
                    error.__cause__ = exc.__cause__ if isinstance(exc, StoreUnavailable | ValueRefused) else exc
                    future.set_exception(error)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


# the node's dedicated session: its node lock (one process per node id) and its LISTEN


class Session:
    """The one connection of a node outside the pool. `notice` is asked first of every payload heard that is
    not a wake-up's count: the notices between gateways come on the same channel (True: it was one)."""

    def __init__(self, db: Database, notice: Callable[[str], bool]) -> None:
        self._db = db
        self._notice = notice
        self._conn: Conn | None = None
        self._node: tuple[str, str] | None = None  # (node_id, instance_id) once lock_node() took it
        self._node_locked = False  # the current connection holds the node lock
        self._lock_missing_said = False

    async def close(self) -> None:
        """Ends the node lock and LISTEN."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with anyio.move_on_after(self._db.connect_timeout_s, shield=True):
                await conn.close()
            conn.terminate()

    async def lock_node(self, node_id: str, instance_id: str) -> None:
        """A session advisory lock on (schema, node_id), held until close()."""
        conn = await self._db.connect("session")
        try:
            if not await conn.fetchval(FLEET["node_lock"], self._node_key(node_id)):
                raise ConfigError(node_taken(node_id, self._db.where, await _holder(conn, node_id)))
        except DRIVER_ERRORS as exc:
            conn.terminate()
            raise StoreUnavailable(
                f"store {self._db.where}: cannot take the lock of node {node_id}: {said(exc)}") from exc
        except BaseException:
            conn.terminate()
            raise
        self._node, self._node_locked = (node_id, instance_id), True
        self._replace(conn)

    async def watch(self, wake: Callable[[int], None], *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """LISTEN until cancelled; re-established with backoff after a drop.

        Reports started at once: the first connection may fail like any later one, and the pool's poll
        covers the gap. After a reconnect every sleeping worker is woken, for what was missed meanwhile.
        """

        def heard(conn: Conn, pid: int, channel: str, payload: str) -> None:
            try:
                n = int(payload)
            except ValueError:
                if self._notice(payload):
                    return
                n = 1
            wake(max(1, min(n, MAX_WAKE)))

        task_status.started()
        waits, dropped = RECONNECT.delays(), False
        while True:
            lost = anyio.Event()
            try:
                conn = await self._listening(lost, heard)
            except SESSION_ERRORS as exc:
                (log.debug if dropped else log.warning)(
                    "store %s: cannot LISTEN (%s); retrying with backoff", self._db.where, exc
                )
                self._drop(self._conn)
                await anyio.sleep(next(waits))
                dropped = True
                continue
            if dropped:
                log.info("store %s: LISTEN connection re-established", self._db.where)
                wake(MAX_WAKE)
            waits, dropped = RECONNECT.delays(), False
            await self._keep(conn, lost)
            log.warning("store %s: LISTEN connection lost; reconnecting", self._db.where)
            dropped = True
            self._drop(conn)

    async def _listening(self, lost: anyio.Event, heard: Callable[[Conn, int, str, str], None]) -> Conn:
        """The session connection (a new one when it is gone), listening; `lost` is set when it ends."""
        conn = self._conn
        if conn is None or conn.is_closed():
            conn = await self._db.connect("session")
            self._node_locked = False  # the server ended the old session, and the lock with it
            self._replace(conn)
            await self._retake_node_lock(conn)
        conn.add_termination_listener(lambda _conn: lost.set())
        await conn.add_listener(self._db.channel, heard)
        return conn

    def _drop(self, conn: Conn) -> None:
        """Close `conn` (None: nothing to close); if it was the session, the node lock went with it."""
        if conn is None:
            return
        conn.terminate()
        if self._conn is conn:
            self._conn, self._node_locked = None, False

    async def _keep(self, conn: Conn, lost: anyio.Event) -> None:
        """Until the connection ends: it is asked to answer every PING_EVERY_S, so a dead peer shows."""
        while not lost.is_set():
            with anyio.move_on_after(PING_EVERY_S):
                await lost.wait()
                return
            try:
                with anyio.fail_after(PING_EVERY_S):
                    await conn.execute("SELECT 1")
                    await self._retake_node_lock(conn)  # not yet taken back after a reconnect: try again
            except DRIVER_ERRORS:
                return

    def _replace(self, conn: Conn) -> None:
        old, self._conn = self._conn, conn
        if old is not None and old is not conn:
            old.terminate()

    async def _retake_node_lock(self, conn: Conn) -> None:
        """After a reconnect the lock went with the old session: take it again, now or at a later ping.

        Until the server notices the old connection is dead, the old session may still hold it.
        """
        if self._node is None or self._node_locked:
            return
        node_id, instance_id = self._node
        if await conn.fetchval(FLEET["node_lock"], self._node_key(node_id)):
            self._node_locked = True
            if self._lock_missing_said:
                log.info("node %s holds its lock on store %s again", node_id, self._db.where)
            self._lock_missing_said = False
            return
        if not self._lock_missing_said:
            other = await _holder(conn, node_id)
            if other is not None and other.instance_id == instance_id:
                log.warning("node %s: its lock is still held by this process' dropped session; will retry", node_id)
            else:
                log.error("%s; this process carries on and retries", node_taken(node_id, self._db.where, other))
            self._lock_missing_said = True

    def _node_key(self, node_id: str) -> str:
        return f"tidepool.node.{self._db.schema}.{node_id}"


async def _holder(conn: Conn, node_id: str) -> Node | None:
    row = await conn.fetchrow(FLEET["node"], node_id)
    return None if row is None else node_of(row, task_types=row[9])


def node_taken(node_id: str, where: str, holder: Node | None) -> str:
    if holder is None:
        who = "another process"
    else:
        seen = time.time() - holder.heartbeat_at
        who = (f"pid {holder.pid} on {holder.hostname} (instance {holder.instance_id}, "
               f"tidepool {holder.version}, heard from {seen:.0f}s ago)")  # fmt: skip
    return (
        f"node {node_id} already runs on store {where}: {who} holds its lock; "
        "stop it or give this daemon another node.id"
    )
