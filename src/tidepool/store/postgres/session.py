"""The dedicated connection of a node: its session advisory lock (one process per node id) and its LISTEN.

Every write that makes tasks claimable (a submit, a retry promotion, an interrupted attempt back to
pending, a schedule firing) sends NOTIFY on the schema's channel, delivered at commit; each node
LISTENs on this one connection, re-established with backoff after a drop, and pings it so that a
silent network drop is noticed. The lock goes with the session: after a reconnect it is taken again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
from anyio.abc import TaskStatus

from ...backoff import Backoff
from ...errors import ConfigError, StoreUnavailable
from ..port import Node
from ..rows import node_of
from .connection import DRIVER_ERRORS, Conn, Connections, said
from .notices import Notices
from .statements import SQL

log = logging.getLogger("tidepool.store.postgres")
SESSION_ERRORS: tuple[type[BaseException], ...] = (StoreUnavailable, *DRIVER_ERRORS)
PING_EVERY_S = 5.0  # the LISTEN connection proves itself this often: a silent network drop is noticed
RECONNECT = Backoff(first_s=0.1, cap_s=5.0)  # between attempts to re-establish the LISTEN connection
MAX_WAKE = 1000  # a notification's count is a hint; no more wake-ups than this from one


class Session:
    def __init__(self, db: Connections, notices: Notices) -> None:
        self._db = db
        self._notices = notices  # the gateways' notices come on the same channel as the wake-ups
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
            if not await conn.fetchval(SQL["node_lock"], self._node_key(node_id)):
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
                if self._notices.heard(payload):
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
        if await conn.fetchval(SQL["node_lock"], self._node_key(node_id)):
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
    row = await conn.fetchrow(SQL["node"], node_id)
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
