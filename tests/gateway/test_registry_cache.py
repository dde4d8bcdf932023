"""The gateway's cache of worker records: an acquire's record, read before a revoke, does not replace the
revoked one cached since."""

from __future__ import annotations

from tidepool.events import EventBus
from tidepool.gateway.control import Controls
from tidepool.gateway.parking import Parking
from tidepool.gateway.registry import WorkerRegistry
from tidepool.gateway.tls import Peer
from tidepool.metrics.gateway import GatewayMetrics
from tidepool.model import CertSeen, WorkerState
from tidepool.store.memory import MemoryStore


async def test_a_record_read_before_a_revoke_does_not_replace_the_revoked_one() -> None:
    now = 1_000.0
    registry = WorkerRegistry(MemoryStore(), EventBus(), Controls(), Parking(),
                              GatewayMetrics(held=lambda: 0, streams=lambda: 0), clock=lambda: now)
    peer = Peer("w1", "ab" * 32, now + 3600, "127.0.0.1")

    async def meet() -> WorkerState:
        worker = await registry.meet(peer, cert=CertSeen(peer.fingerprint, peer.not_after), enroll="auto",
                                     max_concurrent_tasks=4)
        return worker.state

    assert await meet() is WorkerState.ENABLED
    mark = registry.changes  # an acquire begins its read ...
    read = await registry.get("w1")
    await registry.revoke("w1")  # ... a revoke lands meanwhile ...
    assert await meet() is WorkerState.REVOKED
    registry.seen(read, read_after=mark)  # ... and the acquire's older record comes back
    assert await meet() is WorkerState.REVOKED
