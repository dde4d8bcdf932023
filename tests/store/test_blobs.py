"""The blobs' contract on every store: bytes named by their sha256, artifacts fenced like results, inputs
checked at submit, and the pruning that never takes a blob a task names."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tidepool.errors import (
    BlobNotFound,
    BlobTooLarge,
    Conflict,
    DigestMismatch,
    InvalidRequest,
    LeaseLost,
    QuotaExceeded,
)
from tidepool.model import AttemptStatus, Blob, Claimed, ClaimFilter, NewTask, Outcome, Phase, TaskError, Worker
from tidepool.scans import NewScan, StepSpec
from tidepool.store import PhaseNote, Store
from tidepool.store.digests import CHUNK
from tidepool.store.port import ArtifactQuota

from .conftest import LEASE_S, POLICY, SUCCEEDED, T0

NODE = Worker("node-a", "a-1", "worker-1")
QUOTA = ArtifactQuota(max_count=100, max_bytes=1 << 30, max_blob_bytes=1 << 30)
BIG = bytes(range(256)) * (CHUNK * 5 // 2 // 256)  # two and a half chunks
FAILED_RETRYABLE = Outcome(AttemptStatus.FAILED, TaskError("boom", "the plugin broke", True))


async def pieces(data: bytes, size: int = 65536) -> AsyncIterator[bytes]:
    """`data` as a body arrives: in small pieces."""
    for at in range(0, len(data), size):
        yield data[at:at + size]


async def put(store: Store, data: bytes, *, now: float = T0, **kwargs: Any) -> Blob:
    blob, _ = await store.put_blob(pieces(data), now=now, max_bytes=kwargs.pop("max_bytes", 1 << 30), **kwargs)
    return blob


async def read(store: Store, sha256: str, **kwargs: Any) -> bytes:
    chunks = [c async for c in store.read_blob(sha256, **kwargs)]
    assert all(len(c) <= CHUNK for c in chunks)
    return b"".join(chunks)


async def running(store: Store, *, now: float = T0, type: str = "scan", **fields: Any) -> Claimed:
    task, _ = await store.add(NewTask(type, **fields), now=now)
    [claimed] = await store.claim(NODE, ClaimFilter((type,)), limit=1, now=now, lease_s=LEASE_S)
    assert claimed.task.id == task.id
    assert await store.set_phase([PhaseNote(claimed.lease, Phase.RUN)], now=now) == {}
    return claimed


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# blobs


async def test_a_blob_put_reads_back_whole_and_by_range_in_chunks(store: Store) -> None:
    blob, created = await store.put_blob(pieces(BIG), now=T0, max_bytes=len(BIG))
    assert (blob, created) == (Blob(sha(BIG), len(BIG), T0), True)
    assert await store.get_blob(blob.sha256) == blob
    assert await read(store, blob.sha256) == BIG
    for start, stop in ((0, 10), (CHUNK - 5, CHUNK + 5), (CHUNK * 2, None), (7, 7), (len(BIG) - 1, len(BIG) + 9)):
        assert await read(store, blob.sha256, start=start, stop=stop) == BIG[start:stop]


async def test_a_blob_put_again_is_the_same_blob_kept_anew(store: Store) -> None:
    first = await put(store, b"sample")
    again, created = await store.put_blob(pieces(b"sample"), now=T0 + 5, max_bytes=100, expect=sha(b"sample"))
    assert (again, created) == (Blob(first.sha256, first.size, T0 + 5), False)  # it waits for its submit anew


async def test_an_unknown_blob_is_not_found(store: Store) -> None:
    with pytest.raises(BlobNotFound):
        await store.get_blob(sha(b"never"))
    with pytest.raises(BlobNotFound):
        await read(store, sha(b"never"))


async def test_a_wrong_digest_or_too_many_bytes_store_nothing(store: Store) -> None:
    with pytest.raises(DigestMismatch):
        await put(store, BIG, expect=sha(b"other"))
    with pytest.raises(BlobTooLarge):
        await put(store, b"x" * 11, max_bytes=10)
    for data in (BIG, b"x" * 11):
        with pytest.raises(BlobNotFound):
            await store.get_blob(sha(data))
    assert await put(store, b"x" * 10, max_bytes=10) == Blob(sha(b"x" * 10), 10, T0)


# artifacts


async def test_artifacts_are_recorded_from_bytes_and_files_and_listed_oldest_first(store: Store,
                                                                                  tmp_path: Path) -> None:
    c = await running(store)
    (tmp_path / "report.xml").write_bytes(BIG)
    first = await store.record_artifact(c.lease, "stdout", b"open 80", content_type="text/plain", now=T0 + 1,
                                        quota=QUOTA)
    second = await store.record_artifact(c.lease, "report.xml", tmp_path / "report.xml", content_type=None,
                                         now=T0 + 2, quota=QUOTA)
    assert (first.name, first.sha256, first.size, first.content_type, first.attempt_id, first.created_at) == \
        ("stdout", sha(b"open 80"), 7, "text/plain", c.lease.attempt_id, T0 + 1)
    assert (second.sha256, second.size) == (sha(BIG), len(BIG))
    assert await store.list_artifacts(c.task.id) == [first, second]
    assert (await store.get(c.task.id)).artifacts == (first, second)
    assert await read(store, second.sha256) == BIG


async def test_an_artifact_is_fenced_by_its_lease(store: Store) -> None:
    c = await running(store, max_attempts=3)
    stale = type(c.lease)(c.task.id, c.lease.attempt_id, "not-the-token", c.lease.expires_at)
    with pytest.raises(LeaseLost):
        await store.record_artifact(stale, "out", b"x", content_type=None, now=T0 + 1, quota=QUOTA)
    with pytest.raises(LeaseLost):  # its lease is over
        await store.record_artifact(c.lease, "out", b"x", content_type=None, now=T0 + LEASE_S + 1, quota=QUOTA)
    blob = await put(store, b"x")
    with pytest.raises(LeaseLost):  # another remote worker's attempt
        await store.note_artifact(c.lease, "out", blob, content_type=None, now=T0 + 1, quota=QUOTA,
                                  identity="scanner-9")
    await store.finish(c.lease, FAILED_RETRYABLE, now=T0 + 2, policy=POLICY)
    later = await store.claim(NODE, ClaimFilter(("scan",)), limit=1, now=T0 + 1000, lease_s=LEASE_S)
    assert [x.task.id for x in later] == [c.task.id]
    with pytest.raises(LeaseLost):  # the earlier attempt's lease, while another attempt holds the task
        await store.note_artifact(c.lease, "out", blob, content_type=None, now=T0 + 1001, quota=QUOTA)
    assert await store.list_artifacts(c.task.id) == []
    noted = await store.note_artifact(later[0].lease, "out", blob, content_type=None, now=T0 + 1001, quota=QUOTA,
                                      identity=NODE.node_id)
    assert await store.list_artifacts(c.task.id) == [noted]


async def test_an_artifact_is_recorded_once_per_attempt_and_name(store: Store) -> None:
    c = await running(store)
    first = await store.record_artifact(c.lease, "out", b"one", content_type=None, now=T0 + 1, quota=QUOTA)
    assert await store.record_artifact(c.lease, "out", b"one", content_type="text/plain", now=T0 + 2,
                                       quota=QUOTA) == first
    with pytest.raises(Conflict):
        await store.record_artifact(c.lease, "out", b"two", content_type=None, now=T0 + 3, quota=QUOTA)
    assert await store.list_artifacts(c.task.id) == [first]


async def test_artifact_names_are_one_path_segment(store: Store) -> None:
    c = await running(store)
    for name in ("../etc", "a/b", "..", ""):
        with pytest.raises(InvalidRequest):
            await store.record_artifact(c.lease, name, b"x", content_type=None, now=T0 + 1, quota=QUOTA)
    assert await store.list_artifacts(c.task.id) == []


@pytest.mark.parametrize(("quota", "refused"), [
    (ArtifactQuota(max_count=2, max_bytes=100, max_blob_bytes=100), b"third"),
    (ArtifactQuota(max_count=9, max_bytes=12, max_blob_bytes=100), b"third"),
])
async def test_artifacts_past_the_quota_store_nothing(store: Store, quota: ArtifactQuota, refused: bytes) -> None:
    c = await running(store)
    kept = [await store.record_artifact(c.lease, name, data, content_type=None, now=T0 + 1, quota=quota)
            for name, data in (("a", b"first"), ("b", b"second"))]
    with pytest.raises(QuotaExceeded) as caught:
        await store.record_artifact(c.lease, "c", refused, content_type=None, now=T0 + 2, quota=quota)
    assert caught.value.code == "artifact_quota"
    with pytest.raises(QuotaExceeded):
        await store.note_artifact(c.lease, "c", await put(store, b"uploaded"), content_type=None, now=T0 + 2,
                                  quota=quota)
    assert await store.list_artifacts(c.task.id) == kept
    with pytest.raises(BlobNotFound):
        await store.get_blob(sha(refused))
    # an artifact sent again is no new artifact
    assert await store.record_artifact(c.lease, "a", b"first", content_type=None, now=T0 + 3, quota=quota) == kept[0]


async def test_an_artifact_past_the_blob_bound_stores_nothing(store: Store) -> None:
    c = await running(store)
    quota = ArtifactQuota(max_count=9, max_bytes=1000, max_blob_bytes=4)
    with pytest.raises(BlobTooLarge):
        await store.record_artifact(c.lease, "out", b"12345", content_type=None, now=T0 + 1, quota=quota)
    assert await store.list_artifacts(c.task.id) == []
    with pytest.raises(BlobNotFound):
        await store.get_blob(sha(b"12345"))


# inputs


async def test_a_task_keeps_the_inputs_it_was_submitted_with(store: Store, tmp_path: Path) -> None:
    sample = await put(store, BIG)
    c = await running(store, inputs={"sample": sample.sha256})
    assert (await store.get(c.task.id)).inputs == {"sample": sample.sha256}
    assert c.task.inputs == {"sample": sample.sha256}
    assert [t.inputs for t in (await store.list_tasks()).tasks] == [{"sample": sample.sha256}]
    await store.place_input(c.lease, sample.sha256, tmp_path / "sample")
    assert (tmp_path / "sample").read_bytes() == BIG


async def test_place_input_serves_only_the_leased_tasks_inputs(store: Store, tmp_path: Path) -> None:
    sample, other = await put(store, b"sample"), await put(store, b"other")
    c = await running(store, inputs={"sample": sample.sha256})
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    with pytest.raises(BlobNotFound):
        await store.place_input(c.lease, other.sha256, workdir / "other")
    stale = type(c.lease)(c.task.id, c.lease.attempt_id, "not-the-token", c.lease.expires_at)
    with pytest.raises(LeaseLost):
        await store.place_input(stale, sample.sha256, workdir / "sample")
    assert list(workdir.iterdir()) == []


async def test_a_submit_naming_an_unknown_blob_queues_nothing(store: Store) -> None:
    known = await put(store, b"known")
    unknown = sha(b"unknown")
    with pytest.raises(InvalidRequest) as caught:
        await store.add(NewTask("scan", inputs={"a": known.sha256, "sample": unknown}), now=T0)
    assert caught.value.field == "inputs.sample"
    batch = [NewTask("scan", inputs={"a": known.sha256}), NewTask("scan", inputs={"sample": unknown})]
    with pytest.raises(InvalidRequest, match=r"inputs\.sample"):
        await store.add_many(batch, now=T0)
    scan = NewScan("web", (StepSpec("scan"),), inputs={"sample": unknown})
    with pytest.raises(InvalidRequest, match=r"inputs\.sample"):
        await store.add_scan(scan, now=T0)
    assert (await store.list_tasks()).tasks == []
    assert (await store.list_scans()).scans == []


async def test_leased_blob_is_true_only_for_a_live_lease_holder_of_a_task_naming_it(store: Store) -> None:
    sample, other = await put(store, b"sample"), await put(store, b"other")
    c = await running(store, inputs={"sample": sample.sha256})
    assert await store.leased_blob(NODE.node_id, sample.sha256, now=T0 + 1)
    assert not await store.leased_blob("scanner-9", sample.sha256, now=T0 + 1)
    assert not await store.leased_blob(NODE.node_id, other.sha256, now=T0 + 1)
    assert not await store.leased_blob(NODE.node_id, sample.sha256, now=T0 + LEASE_S + 1)  # its lease is over
    await store.finish(c.lease, SUCCEEDED, now=T0 + 2, policy=POLICY)
    assert not await store.leased_blob(NODE.node_id, sample.sha256, now=T0 + 3)


# pruning


async def test_prune_blobs_deletes_old_blobs_no_task_names(store: Store) -> None:
    old, recent = await put(store, b"old"), await put(store, b"recent", now=T0 + 100)
    queued, done, written = await put(store, b"queued"), await put(store, b"done"), await put(store, b"written")
    await store.add(NewTask("waiting", inputs={"in": queued.sha256}), now=T0)
    c = await running(store, inputs={"in": done.sha256})
    await store.record_artifact(c.lease, "out", b"written", content_type=None, now=T0 + 1, quota=QUOTA)
    await store.finish(c.lease, SUCCEEDED, now=T0 + 2, policy=POLICY)
    assert await store.prune_blobs(before=T0 + 50, now=T0 + 200) == 1
    with pytest.raises(BlobNotFound):
        await store.get_blob(old.sha256)
    for kept in (recent, queued, done, written):
        assert (await store.get_blob(kept.sha256)).sha256 == kept.sha256
    # pruning the ended task takes its inputs and artifacts with it: then its blobs go too
    assert await store.prune(before=T0 + 50) == 1
    assert await store.prune_blobs(before=T0 + 50, now=T0 + 200) == 2
    for gone in (done, written):
        with pytest.raises(BlobNotFound):
            await store.get_blob(gone.sha256)
    assert await store.get_blob(queued.sha256) == queued


async def test_prune_blobs_keeps_a_running_scans_inputs(store: Store) -> None:
    sample = await put(store, b"sample")
    scan, _ = await store.add_scan(NewScan("web", (StepSpec("a"), StepSpec("b")), inputs={"s": sample.sha256}),
                                   now=T0)
    assert await store.prune_blobs(before=T0 + 50, now=T0 + 200) == 0
    assert (await store.get_scan(scan.id)).inputs == {"s": sample.sha256}


# scans


async def test_a_scan_step_gets_the_scans_inputs_and_the_earlier_steps_artifacts(store: Store) -> None:
    sample, stale = await put(store, b"sample"), await put(store, b"stale")
    new = NewScan("web", (StepSpec("probe"), StepSpec("parse"), StepSpec("report")),
                  inputs={"sample": sample.sha256, "targets": stale.sha256})
    scan, _ = await store.add_scan(new, now=T0)
    first = await store.get(scan.jobs[0].task_id or "")
    assert first.inputs == {"sample": sample.sha256, "targets": stale.sha256}
    [c] = await store.claim(NODE, ClaimFilter(("probe",)), limit=1, now=T0 + 1, lease_s=LEASE_S)
    report = await store.record_artifact(c.lease, "report.xml", b"<xml/>", content_type=None, now=T0 + 2,
                                         quota=QUOTA)
    targets = await store.record_artifact(c.lease, "targets", b"10.0.0.1", content_type=None, now=T0 + 2,
                                          quota=QUOTA)
    await store.finish(c.lease, SUCCEEDED, now=T0 + 3, policy=POLICY)
    scan = await store.get_scan(scan.id)
    assert scan.jobs[0].artifacts == {"report.xml": report.sha256, "targets": targets.sha256}
    second = await store.get(scan.jobs[1].task_id or "")
    assert second.inputs == {"sample": sample.sha256, "targets": targets.sha256, "report.xml": report.sha256}



async def test_a_retried_job_gets_the_earlier_steps_artifacts_again(store: Store) -> None:
    scan, _ = await store.add_scan(NewScan("web", (StepSpec("probe"), StepSpec("parse", max_attempts=1))), now=T0)
    [c] = await store.claim(NODE, ClaimFilter(("probe",)), limit=1, now=T0 + 1, lease_s=LEASE_S)
    report = await store.record_artifact(c.lease, "report.xml", b"<xml/>", content_type=None, now=T0 + 2,
                                         quota=QUOTA)
    await store.finish(c.lease, SUCCEEDED, now=T0 + 3, policy=POLICY)
    [p] = await store.claim(NODE, ClaimFilter(("parse",)), limit=1, now=T0 + 4, lease_s=LEASE_S)
    await store.finish(p.lease, Outcome(AttemptStatus.FAILED, TaskError("boom", "broke", False)), now=T0 + 5,
                       policy=POLICY)
    retried = await store.retry_job(scan.id, 1, now=T0 + 6)
    assert retried.jobs[1].task_id != p.task.id
    assert (await store.get(retried.jobs[1].task_id or "")).inputs == {"report.xml": report.sha256}
