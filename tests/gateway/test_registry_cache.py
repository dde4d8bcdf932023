"""The gateway's side of the registry without a listener: its cache of worker records (an acquire's record,
read before a revoke, does not replace the revoked one cached since), the tags a submit's check counts, and
the versions it serves."""

from __future__ import annotations

import pytest

from tidepool.errors import WorkerRefused
from tidepool.events import EventBus
from tidepool.gateway.control import Controls
from tidepool.gateway.parking import Parking
from tidepool.gateway.registry import TAGS_FOR_S, WorkerRegistry
from tidepool.gateway.tls import Peer
from tidepool.metrics.gateway import GatewayMetrics
from tidepool.model import CertSeen, ClaimFilter, WorkerChange, WorkerState
from tidepool.store.memory import MemoryStore


async def test_a_record_read_before_a_revoke_does_not_replace_the_revoked_one() -> None:
    now = 1_000.0
    registry = WorkerRegistry(MemoryStore(), EventBus(), Controls(), Parking(),
                              GatewayMetrics(held=lambda: 0, streams=lambda: 0), clock=lambda: now)
    peer = Peer("w1", "ab" * 32, now + 3600, "127.0.0.1", "cd" * 32)

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


async def test_a_submits_tag_check_counts_only_the_tags_a_workers_record_allows() -> None:
    now = 1_000.0
    store = MemoryStore()
    registry = WorkerRegistry(store, EventBus(), Controls(), Parking(),
                              GatewayMetrics(held=lambda: 0, streams=lambda: 0), clock=lambda: now)
    peer = Peer("w1", "ab" * 32, now + 3600, "127.0.0.1", "cd" * 32)
    await registry.meet(peer, cert=CertSeen(peer.fingerprint, peer.not_after), enroll="auto", max_concurrent_tasks=4)
    await store.acquire("w1", ClaimFilter(("noop",)), limit=1, now=now, lease_s=30.0, worker_id="w-1",
                        slots=[["gpu", "lab-1"]], version="0.1.0")
    assert await registry.tag_sets() == [frozenset({"gpu", "lab-1"})]
    await registry.change("w1", WorkerChange(tags=("lab-*",)))
    now += TAGS_FOR_S
    assert await registry.tag_sets() == [frozenset({"lab-1"})]


@pytest.mark.parametrize(("version", "served"), [
    ("0.3.0", True), ("0.3", True), ("0.10.0", True), ("1.0.0rc1", True), ("0.2.9", False), ("0.2.10", False),
    (None, False), ("dev", False)])
async def test_a_version_is_compared_with_min_worker_version_as_numbers(version: str | None, served: bool) -> None:
    now = 1_000.0
    registry = WorkerRegistry(MemoryStore(), EventBus(), Controls(), Parking(),
                              GatewayMetrics(held=lambda: 0, streams=lambda: 0), clock=lambda: now)
    peer = Peer("w1", "ab" * 32, now + 3600, "127.0.0.1", "cd" * 32)
    try:
        await registry.meet(peer, cert=CertSeen(peer.fingerprint, peer.not_after), enroll="auto",
                            max_concurrent_tasks=4, version=version, min_version="0.3.0")
    except WorkerRefused as exc:
        assert not served and exc.code == "worker_outdated"
        assert str(version) in str(exc) or version is None
        assert "0.3.0" in str(exc)
    else:
        assert served
