"""Files over the gateway, on real mutual TLS: an input's bytes only for the worker whose live lease names it,
an artifact recorded once per (attempt, name) after its digest is checked."""

from __future__ import annotations

import io
from typing import Any

import pytest

from tidepool.errors import BlobNotFound
from tidepool.model import Worker
from tidepool.store.port import ArtifactQuota

from .conftest import AUTO, MakeNode, Remote, lease_of, sha_of, with_input

pytestmark = pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
SAMPLE = b"MZ\x90\x00" + bytes(range(256)) * 5000  # past one 1 MiB chunk
WORKER = Worker("w1", "instance", "worker-0")
QUOTA = ArtifactQuota(max_count=100, max_bytes=1 << 30, max_blob_bytes=1 << 30)


async def get(remote: Remote, path: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with remote.session.get(remote.url + path, headers=headers) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def put(remote: Remote, lease: dict[str, Any], name: str, data: bytes, *, digest: str | None = None,
              **headers: str) -> tuple[int, Any]:
    sent = {"X-Lease-Token": lease["lease_token"], "X-Content-SHA256": digest or sha_of(data), **headers}
    async with remote.session.put(f"{remote.url}/w1/artifacts/{lease['attempt_id']}/{name}", data=io.BytesIO(data),
                                  headers=sent) as r:
        return r.status, await r.json(content_type=None)


async def test_an_input_is_served_to_the_worker_whose_live_lease_names_it_and_to_no_one_else(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        _, blob = await with_input(node, SAMPLE)
        w1, w2 = node.remote("w1"), node.remote("w2")
        lease = await w1.leased()
        status, headers, body = await get(w1, f"/w1/blobs/{blob}")
        assert (status, body) == (200, SAMPLE)
        assert (headers["etag"], int(headers["content-length"])) == (f'"{blob}"', len(SAMPLE))
        status, headers, body = await get(w1, f"/w1/blobs/{blob}", Range="bytes=2-5")
        assert (status, body, headers["content-range"]) == (206, SAMPLE[2:6], f"bytes 2-5/{len(SAMPLE)}")
        await w2.acquire()  # w2 is known, and holds no lease naming it
        other = await get(w2, f"/w1/blobs/{blob}")
        unknown = await get(w1, f"/w1/blobs/{'0' * 64}")
        assert (other[0], unknown[0]) == (403, 403)
        assert b"blob_not_leased" in other[2] and b"blob_not_leased" in unknown[2]
        assert (await w1.post("/w1/finish", {"endings": [{**lease_of(lease), "status": "succeeded"}]})).status == 200
        status, _, body = await get(w1, f"/w1/blobs/{blob}")  # its lease has ended
        assert status == 403 and b"blob_not_leased" in body


async def test_an_artifact_is_recorded_once_by_attempt_and_name(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit(max_attempts=1)
        w1 = node.remote("w1")
        lease = await w1.leased()
        status, first = await put(w1, lease, "report.xml", b"<report/>", **{"Content-Type": "application/xml"})
        assert status == 201, first
        assert (first["name"], first["sha256"], first["size"], first["content_type"], first["attempt_id"]) == \
            ("report.xml", sha_of(b"<report/>"), 9, "application/xml", lease["attempt_id"])
        again = await put(w1, lease, "report.xml", b"<report/>", **{"Content-Type": "application/xml"})
        assert again == (200, first)  # an answer lost in transit, sent again: the same record
        status, body = await put(w1, lease, "report.xml", b"<other/>")
        assert (status, body["error"]["code"]) == (409, "conflict")
        (recorded,) = await node.daemon.store.list_artifacts(task_id)
        assert (recorded.name, recorded.sha256) == ("report.xml", sha_of(b"<report/>"))
        status, body = await put(w1, lease, "no spaces", b"x")
        assert (status, body["error"]["code"]) == (400, "invalid_request")
        status, body = await put(w1, {**lease, "lease_token": "not-a-token"}, "a.txt", b"x")
        assert status == 400, body


async def test_an_artifact_whose_body_is_not_its_digest_stores_nothing(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit(max_attempts=1)
        w1 = node.remote("w1")
        lease = await w1.leased()
        status, body = await put(w1, lease, "out.bin", SAMPLE, digest=sha_of(b"something else"))
        assert (status, body["error"]["code"]) == (400, "digest_mismatch"), body
        assert await node.daemon.store.list_artifacts(task_id) == []
        with pytest.raises(BlobNotFound):
            await node.daemon.store.get_blob(sha_of(SAMPLE))


async def test_artifacts_past_the_quotas_are_413_and_store_nothing(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO, artifacts={"max_per_attempt": 1, "max_blob_bytes": 1000}) as node:
        task_id = await node.submit(max_attempts=1)
        w1 = node.remote("w1")
        lease = await w1.leased()
        status, body = await put(w1, lease, "big.bin", SAMPLE)
        assert (status, body["error"]["code"]) == (413, "blob_too_large"), body
        assert (await put(w1, lease, "one.txt", b"one"))[0] == 201
        status, body = await put(w1, lease, "two.txt", b"two")
        assert (status, body["error"]["code"]) == (413, "artifact_quota"), body
        assert [a.name for a in await node.daemon.store.list_artifacts(task_id)] == ["one.txt"]


async def test_an_artifact_behind_a_lease_the_caller_does_not_hold_is_410(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit(max_attempts=1)
        w1, w2 = node.remote("w1"), node.remote("w2")
        lease = await w1.leased()
        status, body = await put(w2, lease, "stolen.txt", b"x")  # w1's lease, sent by w2
        assert (status, body["error"]["code"], body["error"]["reason"]) == (410, "lease_lost", "superseded"), body
        stale = {**lease, "lease_token": lease["lease_token"].rsplit(".", 1)[0] + ".00ff"}
        status, body = await put(w1, stale, "late.txt", b"x")
        assert (status, body["error"]["code"]) == (410, "lease_lost"), body
        assert await node.daemon.store.list_artifacts(task_id) == []
