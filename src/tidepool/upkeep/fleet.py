"""The fleet: this node's heartbeat, and the nodes gone, whose attempts are expired within seconds, not a lease later.

Every node saves its row every `heartbeat_s` (Heartbeat: saved at start, re-saved every heartbeat, marked
stopped at the end) and counts as alive for three of them. The rows are what `GET /v1/nodes` and
`tidepool nodes` show: which nodes share the store, what they accept, and whether each is alive. A node
that cannot reach the store keeps running and says so once per outage; its row goes stale, which is the
truth other nodes should see.

A node not heard of for longer than that (and not stopped cleanly) is gone: each surviving node's watch expires the
gone node's leases at once, as ended when the node was last heard of, so they run again elsewhere
without waiting out the lease. The gone node cannot be working on them any more: its own lease
keeper stops every attempt once its heartbeat has gone unsaved for two heartbeats, on its own
monotonic clock, one heartbeat before anyone may call it gone (see leases.py), if it last saw another
live node: alone, it has nobody to make room for.

A survivor that itself could not reach the store judges nobody: a store outage stales every row
alike, and the others need a few heartbeats to be heard of again once it is over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import anyio
from anyio.abc import TaskStatus

from ..errors import StoreUnavailable
from ..lifecycle import RetryPolicy
from ..logs import Outage
from ..store import Expired, Node, Store

log = logging.getLogger("tidepool.fleet")
CHECK_EVERY_S = 1.0
GONE_AFTER_BEATS = 3  # as Node.alive counts: `tidepool nodes` says `alive no` when the watch acts
FENCE_AFTER_BEATS = 2  # a node stops its own attempts one heartbeat before the others may call it gone


def gone_after_s(heartbeat_s: float) -> float:
    return GONE_AFTER_BEATS * heartbeat_s


def fence_after_s(heartbeat_s: float) -> float:
    return FENCE_AFTER_BEATS * heartbeat_s


class GoneNodes:
    """Each second: find the nodes gone since the last look, expire their attempts, say so once per node."""

    def __init__(self, store: Store, *, node_id: str, policy: Callable[[], RetryPolicy],
                 report: Callable[[list[Expired], str], None],
                 fleet_seen: Callable[[bool], None] = lambda others_alive: None,
                 check_every_s: float = CHECK_EVERY_S, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._node_id = node_id
        self._policy = policy
        self._report = report  # the reconciler's account of expired leases: log lines, events, wake-ups
        self._fleet_seen = fleet_seen  # the lease keeper's fence: it need not stop attempts nobody could take
        self._check_every_s = check_every_s
        self._clock = clock
        self._steady_since: float | None = None  # since when our own heartbeats have gone through
        self._judged: dict[str, float] = {}  # gone node -> the heartbeat it was judged on
        self._outage = Outage(log)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await anyio.sleep(self._check_every_s)
            try:
                await self.check_once()
            except StoreUnavailable as exc:
                self._outage.failing("gone nodes not looked for until the store answers: %s", exc)
                self._steady_since = None
                continue
            self._outage.over("gone nodes: the store answers again")

    async def check_once(self) -> dict[str, int]:
        """Expire the attempts of every node gone since the last look: {node: attempts expired}."""
        now = self._clock()
        nodes = await self._store.list_nodes()
        self._fleet_seen(any(n.node_id != self._node_id and n.alive(now) for n in nodes))
        if not self._steady(nodes, now):
            return {}
        found: dict[str, int] = {}
        for node in nodes:
            if self._is_gone(node, now) and self._judged.get(node.node_id) != node.heartbeat_at:
                found[node.node_id] = await self._expire(node, now)
        self._judged = {n.node_id: n.heartbeat_at for n in nodes if self._is_gone(n, now)}
        return found

    def _steady(self, nodes: list[Node], now: float) -> bool:
        """Whether our own heartbeats have gone through for as long as it takes to call another node gone."""
        own = next((n for n in nodes if n.node_id == self._node_id), None)
        if own is None or not own.alive(now) or now - own.heartbeat_at > 1.5 * own.heartbeat_s:
            self._steady_since = None
            return False
        if self._steady_since is None:
            self._steady_since = now
        return now - self._steady_since >= gone_after_s(own.heartbeat_s)

    def _is_gone(self, node: Node, now: float) -> bool:
        return (node.node_id != self._node_id and node.stopped_at is None
                and now - node.heartbeat_at > gone_after_s(node.heartbeat_s))

    async def _expire(self, node: Node, now: float) -> int:
        """Expire the gone node's attempts as ended when it was last heard of: their retries' backoff runs
        from then, and an attempt's `took` is the time the node was seen working on it.

        Any instance of the node id is meant: one that came back under it would have saved a fresh
        heartbeat before claiming anything, and would not be gone."""
        expired = await self._store.expire_leases(now=node.heartbeat_at, policy=self._policy(),
                                                  node_id=node.node_id, keep_instance=None)
        log.warning("node %s is gone: not heard of for %.1fs (since %s); %d of its attempts expired",
                    node.node_id, now - node.heartbeat_at, _utc(node.heartbeat_at), len(expired))
        self._report(expired, f"node {node.node_id} gone")
        return len(expired)


def _utc(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts))


heartbeat_log = logging.getLogger("tidepool.nodes")  # the name the heartbeat's lines always had
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
        self._outage = Outage(heartbeat_log)

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
                heartbeat_log.warning("node %s could not record its stop: %s", node.node_id, exc)

