"""This node's row in the fleet's registry: saved at start, re-saved every heartbeat, marked stopped at the end.

The registry is what `GET /v1/nodes` and `tidepool nodes` show: which nodes share the store, what
they accept, and whether each is alive (heard from within three of its own heartbeats). A node
that cannot reach the store keeps running and says so once per outage; its row goes stale, which
is the truth other nodes should see.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import anyio
from anyio.abc import TaskStatus

from .errors import StoreUnavailable
from .logs import Outage
from .store import Node, Store

log = logging.getLogger("tidepool.nodes")
HEARTBEAT_S = 2.0
LEAVE_TIMEOUT_S = 2.0  # a clean shutdown waits this long at most to say it stopped


class Heartbeat:
    """Saves `describe(now)` every interval_s; describe() reads the live figures (max_workers changes live)."""

    def __init__(self, store: Store, describe: Callable[[float], Node], *, interval_s: float = HEARTBEAT_S,
                 on_saved: Callable[[float], None] = lambda started: None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._describe = describe
        self._on_saved = on_saved  # given the monotonic time the saved beat started: the lease keeper's fence
        self.interval_s = interval_s
        self._clock = clock
        self._monotonic = monotonic
        self._outage = Outage(log)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.beat()
        task_status.started()
        while True:
            await anyio.sleep(self.interval_s)
            await self.beat()

    async def beat(self) -> bool:
        """Save this node's row; False (logged once per outage) when the store is unavailable."""
        started = self._monotonic()
        node = self._describe(self._clock())
        try:
            await self._store.save_node(node)
        except StoreUnavailable as exc:
            self._outage.failing("node %s heartbeat not saved, will retry: %s", node.node_id, exc)
            return False
        self._on_saved(started)
        self._outage.over("node %s heartbeat saved again", node.node_id)
        return True

    async def leave(self) -> None:
        """Clean shutdown: mark the row stopped so the fleet sees it at once, not three heartbeats later."""
        now = self._clock()
        node = self._describe(now)
        with anyio.move_on_after(LEAVE_TIMEOUT_S, shield=True):
            try:
                await self._store.save_node(replace(node, stopped_at=now))
            except StoreUnavailable as exc:
                log.warning("node %s could not record its stop: %s", node.node_id, exc)

