"""Files through the API, on a whole node run in this process (files_node) over real HTTP: uploads with and
without a digest, the refusals that store nothing, downloads whole, by range and HEAD, submits naming inputs,
a task's artifacts listed and downloaded, and the `tidepool` command's --input, artifacts and fetch."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import anyio
import pytest

from ..files_node import DATA, MAX_BLOB, QUOTA, STORE_URLS, Node, NodeAt, running, sha


@pytest.fixture(params=STORE_URLS)
def a_node(request: pytest.FixtureRequest, tmp_path: Path) -> NodeAt:
    """`async with a_node() as node:` runs the node on each store."""
    return partial(running, tmp_path, str(request.param))


async def test_an_upload_is_stored_once_and_named_by_its_sha256(a_node: NodeAt) -> None:
    async with a_node() as node:
        assert await node.upload(DATA) == (201, {"sha256": sha(DATA), "size": len(DATA)})
        assert await node.upload(DATA, **{"X-Content-SHA256": sha(DATA)}) == (200, {"sha256": sha(DATA),
                                                                                 "size": len(DATA)})
        status, body, r = await node.call("GET", f"/v1/blobs/{sha(DATA)}")
        assert status == 200 and body == DATA
        assert r.headers["ETag"] == f'"{sha(DATA)}"' and r.headers["Content-Type"] == "application/octet-stream"
        assert int(r.headers["Content-Length"]) == len(DATA)


async def test_a_body_that_is_not_the_digest_named_stores_nothing(a_node: NodeAt) -> None:
    async with a_node() as node:
        status, body = await node.upload(b"other bytes", **{"X-Content-SHA256": sha(b"the bytes meant")})
        assert status == 400 and body["error"]["code"] == "digest_mismatch", body
        assert "X-Content-SHA256" in body["error"]["message"]
        for digest in (sha(b"other bytes"), sha(b"the bytes meant")):
            assert (await node.call("GET", f"/v1/blobs/{digest}"))[0] == 404


async def test_a_blob_past_max_blob_bytes_is_413_and_stores_nothing(a_node: NodeAt) -> None:
    async with a_node() as node:
        too_big = b"x" * (MAX_BLOB * 2 + 1)
        status, body = await node.upload(too_big)
        assert status == 413 and body["error"]["code"] == "blob_too_large"
        assert "max_blob_bytes" in body["error"]["message"]
        assert (await node.call("HEAD", f"/v1/blobs/{sha(too_big)}"))[0] == 404

        async def streamed() -> AsyncIterator[bytes]:  # no Content-Length: found out while it streams
            for _ in range(3):
                yield b"y" * MAX_BLOB

        status, body, _ = await node.call("POST", "/v1/blobs", data=streamed(),
                                          headers={"Content-Type": "application/octet-stream"})
        assert status == 413 and body["error"]["code"] == "blob_too_large"
        assert (await node.call("GET", f"/v1/blobs/{sha(b'y' * MAX_BLOB * 3)}"))[0] == 404


async def test_a_refused_upload_names_what_is_wrong(a_node: NodeAt) -> None:
    async with a_node() as node:
        status, body, _ = await node.call("POST", "/v1/blobs", data=b"x", headers={"Content-Type": "text/plain"})
        assert status == 415
        status, body = await node.upload(b"x", **{"X-Content-SHA256": "ABC"})
        assert status == 400 and body["error"]["message"].startswith("X-Content-SHA256:")
        status, body, _ = await node.call("GET", "/v1/blobs/not-a-sha")
        assert status == 400 and body["error"]["message"].startswith("sha256:")
        status, body, _ = await node.call("GET", f"/v1/blobs/{sha(b'never uploaded')}")
        assert status == 404 and body["error"]["code"] == "blob_not_found"


async def test_a_range_a_suffix_and_a_head_answer_as_http_says(a_node: NodeAt) -> None:
    async with a_node() as node:
        await node.upload(DATA)
        path = f"/v1/blobs/{sha(DATA)}"
        status, body, r = await node.call("GET", path, headers={"Range": "bytes=1000-1999999"})
        assert status == 206 and body == DATA[1000:]
        assert r.headers["Content-Range"] == f"bytes 1000-{len(DATA) - 1}/{len(DATA)}"
        status, body, r = await node.call("GET", path, headers={"Range": "bytes=10-19"})
        assert (status, body, r.headers["Content-Length"]) == (206, DATA[10:20], "10")
        status, body, _ = await node.call("GET", path, headers={"Range": "bytes=-5"})
        assert (status, body) == (206, DATA[-5:])
        status, body, r = await node.call("GET", path, headers={"Range": f"bytes={len(DATA)}-"})
        assert status == 416 and r.headers["Content-Range"] == f"bytes */{len(DATA)}"
        status, body, r = await node.call("GET", path, headers={"Range": "bytes=0-1,5-6"})  # several: the whole blob
        assert status == 200 and body == DATA
        status, body, r = await node.call("HEAD", path)
        assert status == 200 and body == b"" and int(r.headers["Content-Length"]) == len(DATA)
        assert r.headers["ETag"] == f'"{sha(DATA)}"'


async def test_a_submit_names_its_inputs_and_the_task_shows_them(a_node: NodeAt) -> None:
    async with a_node() as node:
        await node.upload(b"192.0.2.1\n")
        inputs = {"targets.txt": sha(b"192.0.2.1\n")}
        status, task, _ = await node.call("POST", "/v1/tasks", json={"type": "noop", "inputs": inputs})
        assert status == 201 and task["inputs"] == inputs and task["artifacts"] == []
        assert (await node.call("GET", f"/v1/tasks/{task['id']}"))[1]["inputs"] == inputs


@pytest.mark.parametrize("inputs, field", [
    ({"../etc": "0" * 64}, "inputs.../etc"), ({"..": "0" * 64}, "inputs..."), ({"a b": "0" * 64}, "inputs.a b"),
    ({"sample": "0" * 63}, "inputs.sample"), ({"sample": "A" * 64}, "inputs.sample"),
    ({"sample": "0" * 64}, "inputs.sample")])  # the last: well formed, but no such blob
async def test_a_bad_or_unknown_input_is_400_naming_it_and_queues_nothing(a_node: NodeAt, inputs: dict[str, str],
                                                                          field: str) -> None:
    async with a_node() as node:
        status, body, _ = await node.call("POST", "/v1/tasks", json={"type": "noop", "inputs": inputs})
        assert status == 400 and body["error"]["message"].startswith(field + ":"), body
        status, body, _ = await node.call("POST", "/v1/tasks/batch",
                                          json={"tasks": [{"type": "noop"}, {"type": "noop", "inputs": inputs}]})
        assert status == 400 and field.removeprefix("inputs") in body["error"]["message"], body
        status, body, _ = await node.call("POST", "/v1/scans", json={"profile": "nothing", "inputs": inputs})
        assert status == 400
        assert (await node.call("GET", "/v1/tasks"))[1]["tasks"] == []


async def test_a_task_s_artifacts_are_listed_and_downloaded_the_newest_attempt_s_by_default(a_node: NodeAt) -> None:
    async with a_node() as node:
        claimed = await node.leased()
        store, task_id = node.daemon.store, claimed.task.id
        await store.record_artifact(claimed.lease, "report.xml", DATA, content_type="application/xml",
                                    now=time.time(), quota=QUOTA)
        await store.record_artifact(claimed.lease, "stdout", b"open 80\n", content_type=None, now=time.time(),
                                    quota=QUOTA)
        status, listed, _ = await node.call("GET", f"/v1/tasks/{task_id}/artifacts")
        assert status == 200
        shown = [(a["name"], a["sha256"], a["size"], a["content_type"], a["attempt_id"]) for a in listed["artifacts"]]
        assert shown == [
            ("report.xml", sha(DATA), len(DATA), "application/xml", claimed.lease.attempt_id),
            ("stdout", sha(b"open 80\n"), 8, None, claimed.lease.attempt_id)]
        assert (await node.call("GET", f"/v1/tasks/{task_id}"))[1]["artifacts"] == listed["artifacts"]

        status, body, r = await node.call("GET", f"/v1/tasks/{task_id}/artifacts/report.xml")
        assert status == 200 and body == DATA and r.headers["Content-Type"] == "application/xml"
        assert r.headers["Content-Disposition"] == 'attachment; filename="report.xml"'
        status, body, r = await node.call("GET", f"/v1/tasks/{task_id}/artifacts/stdout",
                                          params={"attempt": claimed.lease.attempt_id})
        assert (status, body, r.headers["Content-Type"]) == (200, b"open 80\n", "application/octet-stream")
        status, body, _ = await node.call("GET", f"/v1/tasks/{task_id}/artifacts/stdout", params={"attempt": "nope"})
        assert status == 404 and "attempt nope" in body["error"]["message"]
        status, body, _ = await node.call("GET", f"/v1/tasks/{task_id}/artifacts/missing.txt")
        assert status == 404 and "missing.txt" in body["error"]["message"]
        assert (await node.call("GET", "/v1/tasks/06H2NOSUCHTASK000000000000/artifacts"))[0] == 404


async def test_the_metrics_count_bytes_stored_received_and_sent(a_node: NodeAt) -> None:
    async with a_node() as node:
        await node.upload(DATA)
        await node.upload(DATA)
        await node.call("GET", f"/v1/blobs/{sha(DATA)}", headers={"Range": "bytes=0-99"})
        _, text, _ = await node.call("GET", "/metrics")
        figures = dict(line.rsplit(" ", 1) for line in text.decode().splitlines() if line.startswith("tidepool_blob"))
        assert float(figures["tidepool_blob_bytes_stored_total"]) == len(DATA)
        assert float(figures["tidepool_blob_bytes_received_total"]) == 2 * len(DATA)
        assert float(figures["tidepool_blob_bytes_sent_total"]) == 100


async def tidepool(node: Node, *args: str, cwd: Path) -> tuple[int, str, str]:
    """The `tidepool` command against the node, as an operator runs it (the node keeps serving meanwhile)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    done = await anyio.run_process([sys.executable, "-m", "tidepool", *args, "--url", node.url], cwd=cwd, env=env,
                                   check=False)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_the_cli_uploads_inputs_submits_and_fetches_an_artifact_checked(a_node: NodeAt, tmp_path: Path) -> None:
    (tmp_path / "sample.bin").write_bytes(DATA)
    async with a_node() as node:
        code, out, err = await tidepool(node, "submit", "noop", "--input", "sample=sample.bin", cwd=tmp_path)
        assert code == 0, err
        task_id = out.strip()
        task = (await node.call("GET", f"/v1/tasks/{task_id}"))[1]
        assert task["inputs"] == {"sample": sha(DATA)}
        assert (await node.call("GET", f"/v1/blobs/{sha(DATA)}"))[1] == DATA

        await node.artifact(await node.lease(), "report.bin", DATA[::-1])
        code, out, err = await tidepool(node, "artifacts", task_id, cwd=tmp_path)
        assert code == 0 and "report.bin" in out and sha(DATA[::-1]) in out, err
        code, out, _ = await tidepool(node, "artifacts", task_id, "--json", cwd=tmp_path)
        assert [a["name"] for a in json.loads(out)["artifacts"]] == ["report.bin"]
        code, out, _ = await tidepool(node, "show", task_id, cwd=tmp_path)
        assert code == 0 and "report.bin" in out and f"input sample sha256 {sha(DATA)}" in out

        (tmp_path / "out").mkdir()
        code, out, err = await tidepool(node, "fetch", task_id, "report.bin", "-o", "out", cwd=tmp_path)
        assert code == 0, err
        assert (tmp_path / "out" / "report.bin").read_bytes() == DATA[::-1]
        assert os.listdir(tmp_path / "out") == ["report.bin"], "the temporary file is gone"
        code, _, err = await tidepool(node, "fetch", task_id, "nothing.txt", cwd=tmp_path)
        assert code == 2 and "no artifact 'nothing.txt'" in err


async def test_the_cli_starts_a_scan_with_inputs_and_shows_them(a_node: NodeAt, tmp_path: Path) -> None:
    (tmp_path / "targets.txt").write_bytes(b"192.0.2.7\n")
    async with a_node() as node:
        code, out, err = await tidepool(node, "scan", "twice", "--input", "targets=targets.txt", cwd=tmp_path)
        assert code == 0, err
        scan = (await node.call("GET", f"/v1/scans/{out.strip()}"))[1]
        targets = sha(b"192.0.2.7\n")
        assert scan["inputs"] == {"targets": targets}
        assert [job["artifacts"] for job in scan["jobs"]] == [{}, {}]
        code, out, err = await tidepool(node, "scan", "show", scan["id"], cwd=tmp_path)
        assert code == 0 and f"input targets sha256 {targets}" in out, err


async def test_the_cli_refuses_a_bad_input_before_uploading_anything(a_node: NodeAt, tmp_path: Path) -> None:
    async with a_node() as node:
        for given, said in (("sample", "expected NAME=FILE"), ("../x=f", "the name must be"),
                            ("sample=missing.bin", "no such file")):
            code, _, err = await tidepool(node, "submit", "noop", "--input", given, cwd=tmp_path)
            assert code == 2 and said in err, err
        assert (await node.call("GET", "/v1/tasks"))[1]["tasks"] == []


async def test_fetch_leaves_nothing_when_the_bytes_are_not_the_artifact_s(tmp_path: Path) -> None:
    async with running(tmp_path, STORE_URLS[-1]) as node:
        claimed = await node.leased()
        await node.artifact(claimed, "report.bin", DATA)
        [stored] = (tmp_path / "var").rglob(sha(DATA))  # the blob's file, altered on the disk behind the store
        stored.chmod(0o600)
        stored.write_bytes(DATA[::-1])
        code, _, err = await tidepool(node, "fetch", claimed.task.id, "report.bin", cwd=tmp_path)
        assert code == 3 and f"not the artifact's {sha(DATA)}" in err, err
        assert not (tmp_path / "report.bin").exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".report.bin")] == [], "no temporary file left"
