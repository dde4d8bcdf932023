"""A remote worker's files through its store adapter, against a real gateway: inputs placed from its cache
(fetched once, evicted past cache_mb), artifacts uploaded from a file once."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from tidepool.errors import BlobNotFound, Conflict, LeaseLost
from tidepool.model import ClaimFilter, Lease, Worker
from tidepool.store.port import ArtifactQuota
from tidepool.store.remote import RemoteStore

from .conftest import AUTO, MakeNode, sha_of, stored, with_input

pytestmark = pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
WORKER = Worker("w1", "instance", "worker-0")
SAMPLE = bytes(range(256)) * 5000  # past one 1 MiB chunk
QUOTA = ArtifactQuota(max_count=100, max_bytes=1 << 30, max_blob_bytes=1 << 30)


def fetches(node: Any) -> list[str]:
    """The sha256 of each GET /w1/blobs the gateway answers from now on: its store is asked whether the caller's
    lease names the blob, once per fetch (the real call, counted on its way)."""
    fetched: list[str] = []
    asked = node.daemon.store.leased_blob

    async def counted(identity: str, sha256: str, *, now: float) -> bool:
        fetched.append(sha256)
        return bool(await asked(identity, sha256, now=now))

    node.daemon.store.leased_blob = counted
    return fetched


async def remote_store(node: Any) -> RemoteStore:
    issued = node.lab.workers["w1"]
    store = RemoteStore(node.w1, cert_file=str(issued.cert), key_file=str(issued.key), ca_file=str(node.lab.ca_file))
    await store.open()
    return store


async def claimed(store: RemoteStore) -> Lease:
    (claim,) = await store.claim(WORKER, ClaimFilter(types=("noop",)), limit=1, now=time.time(), lease_s=30.0)
    return claim.lease


async def test_a_remote_worker_places_an_input_from_its_cache_once_fetched(make_node: MakeNode,
                                                                           tmp_path: Path) -> None:
    async with make_node(gateway=AUTO) as node:
        store = await remote_store(node)
        try:
            store.keep_inputs(tmp_path / "cache", cache_mb=64)
            _, blob = await with_input(node, SAMPLE)
            await with_input(node, SAMPLE)
            first, second = await claimed(store), await claimed(store)
            await store.place_input(first, blob, tmp_path / "a")
            assert (tmp_path / "a").read_bytes() == SAMPLE
            assert (tmp_path / "cache" / blob).read_bytes() == SAMPLE
            fetched = fetches(node)
            async with anyio.create_task_group() as tg:
                for name in ("b", "c"):
                    tg.start_soon(store.place_input, second, blob, tmp_path / name)
            assert fetched == []  # from the cache, not the gateway
            assert (tmp_path / "b").read_bytes() == (tmp_path / "c").read_bytes() == SAMPLE
        finally:
            await store.close()


async def test_concurrent_places_of_one_input_fetch_it_once_and_the_cache_evicts_past_cache_mb(
        make_node: MakeNode, tmp_path: Path) -> None:
    async with make_node(gateway=AUTO) as node:
        store = await remote_store(node)
        try:
            store.keep_inputs(tmp_path / "cache", cache_mb=2)  # room for one 1.3 MB input, not two
            _, big = await with_input(node, SAMPLE)
            other_data = SAMPLE[::-1]
            _, other = await with_input(node, other_data)
            fetched = fetches(node)
            first, second = await claimed(store), await claimed(store)
            async with anyio.create_task_group() as tg:
                for name in ("a", "b", "c"):
                    tg.start_soon(store.place_input, first, big, tmp_path / name)
            assert fetched == [big]
            assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([big, "tmp"])
            await store.place_input(second, other, tmp_path / "d")
            assert (tmp_path / "d").read_bytes() == other_data
            assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([other, "tmp"])
            orphan = await stored(node, b"no task names it")
            with pytest.raises(BlobNotFound):
                await store.place_input(second, orphan, tmp_path / "e")
        finally:
            await store.close()


async def test_a_remote_worker_records_an_artifact_from_a_file_once(make_node: MakeNode, tmp_path: Path) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit(max_attempts=1)
        store = await remote_store(node)
        try:
            lease = await claimed(store)
            source = tmp_path / "raw.pcap"
            source.write_bytes(SAMPLE)
            artifact = await store.record_artifact(lease, "raw.pcap", source, content_type=None, now=time.time(),
                                                   quota=QUOTA)
            assert (artifact.sha256, artifact.size, artifact.content_type) == (sha_of(SAMPLE), len(SAMPLE), None)
            again = await store.record_artifact(lease, "raw.pcap", source, content_type=None, now=time.time(),
                                                quota=QUOTA)
            assert again == artifact
            with pytest.raises(Conflict):
                await store.record_artifact(lease, "raw.pcap", b"other", content_type=None, now=time.time(),
                                            quota=QUOTA)
            stale = Lease(lease.task_id, lease.attempt_id, lease.token.rsplit(".", 1)[0] + ".00ff", lease.expires_at)
            with pytest.raises(LeaseLost):
                await store.record_artifact(stale, "late.txt", b"x", content_type=None, now=time.time(), quota=QUOTA)
        finally:
            await store.close()
        (recorded,) = await node.daemon.store.list_artifacts(task_id)
        assert (recorded.name, recorded.sha256) == ("raw.pcap", sha_of(SAMPLE))


async def test_with_cache_mb_0_an_input_is_kept_only_while_it_is_placed_and_a_kept_one_outlives_a_restart(
        make_node: MakeNode, tmp_path: Path) -> None:
    async with make_node(gateway=AUTO) as node:
        store = await remote_store(node)
        try:
            store.keep_inputs(tmp_path / "none", cache_mb=0)
            _, blob = await with_input(node, SAMPLE)
            lease = await claimed(store)
            await store.place_input(lease, blob, tmp_path / "a")
            assert (tmp_path / "a").read_bytes() == SAMPLE
            assert [p.name for p in (tmp_path / "none").iterdir()] == ["tmp"]
            store.keep_inputs(tmp_path / "kept", cache_mb=64)
            await store.place_input(lease, blob, tmp_path / "b")
            (tmp_path / "kept" / "tmp" / "left-by-a-crash").write_bytes(b"partial")
        finally:
            await store.close()
        again = await remote_store(node)  # a new process of the worker, on the same state_dir
        try:
            fetched = fetches(node)
            again.keep_inputs(tmp_path / "kept", cache_mb=64)
            assert list((tmp_path / "kept" / "tmp").iterdir()) == []
            await again.place_input(lease, blob, tmp_path / "c")  # from the cache: the gateway is not asked
            assert fetched == [] and (tmp_path / "c").read_bytes() == SAMPLE
        finally:
            await again.close()
