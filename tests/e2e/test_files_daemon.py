"""Files through real daemons: an upload and an artifact PUT cut by SIGKILL leave nothing after the restart, a
1 GiB blob goes in and out with the daemon's memory watched, and on a PostgreSQL fleet a file uploaded to one
node is the input of a task another node runs, whose artifact the first serves."""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import ssl
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ..lab import make_lab
from ..w1_client import Remote, client_context
from .conftest import Daemon
from .gateway_helpers import WORKERS, Gateway, ended, submit
from .pg_fleet import Fleet

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20
BODY = os.urandom(MIB) * 6  # six distinct-enough chunks of a partial upload: all its bytes are random
SHA = hashlib.sha256(BODY).hexdigest()


def start_partial_upload(host: str, port: int, body: bytes, *, sent: int,
                         context: ssl.SSLContext | None = None, path: str = "/v1/blobs",
                         headers: dict[str, str] | None = None, method: str = "POST") -> socket.socket:
    """A request that announces all of `body` and sends only its first `sent` bytes, then stalls."""
    raw = socket.create_connection((host, port), timeout=10)
    conn = context.wrap_socket(raw, server_hostname=host) if context is not None else raw
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/octet-stream",
            f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body[:sent])
    return conn


def wait_for(what: str, check: Callable[[], Any], daemon: Daemon, *, timeout_s: float = 20.0) -> Any:
    return daemon.wait_for(what, check, timeout_s=timeout_s)


def staged_files(state_dir: Path) -> list[Path]:
    tmp = state_dir / "blobs" / "tmp"
    return [p for p in tmp.iterdir()] if tmp.exists() else []


def blob_files(state_dir: Path) -> list[Path]:
    root = state_dir / "blobs"
    return [p for p in root.glob("??/*")] if root.exists() else []


def test_a_daemon_killed_during_an_upload_shows_none_of_it_after_its_restart(make_daemon: Callable[..., Daemon]
                                                                                 ) -> None:
    daemon = make_daemon()
    daemon.start()
    partial = start_partial_upload("127.0.0.1", daemon.port, BODY, sent=3 * MIB)
    try:
        wait_for("the upload's bytes on disk", lambda: any(p.stat().st_size >= MIB
                                                            for p in staged_files(daemon.state_dir)), daemon)
        daemon.kill()
    finally:
        partial.close()
    assert staged_files(daemon.state_dir)  # what the kill left behind, before the restart
    daemon.start()
    assert daemon.get(f"/v1/blobs/{SHA}").status == 404
    assert staged_files(daemon.state_dir) == [] and blob_files(daemon.state_dir) == []
    assert daemon.query("SELECT count(*) FROM blobs") == [(0,)]
    whole = daemon.request("POST", "/v1/blobs", data=BODY, content_type="application/octet-stream",
                           headers={"X-Content-SHA256": SHA})
    assert (whole.status, whole.body["sha256"], whole.body["size"]) == (201, SHA, len(BODY))


def test_a_postgresql_node_killed_during_an_upload_keeps_no_chunk_of_it(fleet: Fleet) -> None:
    node = fleet.add("uploads")
    fleet.start(node)
    partial = start_partial_upload("127.0.0.1", node.port, BODY, sent=3 * MIB)
    try:
        fleet.wait("the upload's connection", lambda: fleet.q(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state = 'idle in transaction'",
            f"tidepool {fleet.schema} blob upload")[0][0] == 1)
        node.kill()
    finally:
        partial.close()
    node.start()
    assert node.get(f"/v1/blobs/{SHA}").status == 404
    assert fleet.q("SELECT (SELECT count(*) FROM blobs), (SELECT count(*) FROM blob_chunks)") == [(0, 0)]
    whole = node.request("POST", "/v1/blobs", data=BODY, content_type="application/octet-stream")
    assert (whole.status, whole.body["sha256"]) == (201, SHA)


def test_a_gateway_killed_during_an_artifact_put_records_nothing_and_takes_it_whole_after_restart(
        tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab, lease={"duration_s": 60.0, "renew_every_s": 20.0})
    gateway.start()
    try:
        task_id = submit(gateway, "noop", max_attempts=1)
        remote = Remote(gateway.gateway_url, client_context(lab, "scan-a"))
        acquired = remote.call("/w1/acquire", {"types": ["noop"], "max": 1, "wait_s": 5})
        assert acquired.status == 200, acquired
        (lease,) = acquired.body["tasks"]
        path = f"/w1/artifacts/{lease['attempt_id']}/report.bin"
        headers = {"X-Lease-Token": lease["lease_token"], "X-Content-SHA256": SHA}
        partial = start_partial_upload("127.0.0.1", gateway.gateway_port, BODY, sent=3 * MIB, method="PUT",
                                       context=client_context(lab, "scan-a"), path=path, headers=headers)
        try:
            wait_for("the artifact's bytes on disk", lambda: any(p.stat().st_size >= MIB
                                                                  for p in staged_files(gateway.state_dir)), gateway)
            gateway.kill()
        finally:
            partial.close()
        gateway.start()
        assert staged_files(gateway.state_dir) == [] and blob_files(gateway.state_dir) == []
        assert gateway.query("SELECT count(*) FROM artifacts") == [(0,)]
        assert gateway.task(task_id)["artifacts"] == []
        put = put_whole(gateway, lab, path, headers)
        assert put.status == 201, put.read()
        finished = remote.call("/w1/finish", {"endings": [{"attempt_id": lease["attempt_id"],
                                                           "lease_token": lease["lease_token"],
                                                           "status": "succeeded"}]})
        assert finished.status == 200, finished
        done = ended(gateway, task_id)
        assert done["state"] == "completed"
        assert [(a["name"], a["sha256"], a["size"]) for a in done["artifacts"]] == [("report.bin", SHA, len(BODY))]
        assert download(gateway, f"/v1/tasks/{task_id}/artifacts/report.bin") == BODY
    finally:
        gateway.stop()


def put_whole(gateway: Gateway, lab: Any, path: str, headers: dict[str, str]) -> http.client.HTTPResponse:
    conn = http.client.HTTPSConnection("127.0.0.1", gateway.gateway_port, context=client_context(lab, "scan-a"),
                                       timeout=30)
    conn.request("PUT", path, BODY, {**headers, "Content-Type": "application/octet-stream"})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def download(daemon: Daemon, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    conn.request("GET", path)
    response = conn.getresponse()
    assert response.status == 200
    data = response.read()
    conn.close()
    return data


GIB = 1 << 30
RSS_GROWTH_MAX = 64 * MIB


class RssWatch:
    """The largest resident set of a process seen while the block runs, sampled every 20 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self._stop = threading.Event()
        self.peak = 0

    def __enter__(self) -> RssWatch:
        self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._process.memory_info().rss)


def gib_of(block: bytes) -> Iterator[bytes]:
    for n in range(GIB // len(block)):
        yield n.to_bytes(8, "big") + block[8:]  # each MiB differs, none is kept


def test_a_1_gib_blob_streams_in_and_out_within_64_mib_of_the_daemons_memory(make_daemon: Callable[..., Daemon]
                                                                            ) -> None:
    daemon = make_daemon()
    daemon.start()
    block = os.urandom(MIB)
    digest = hashlib.sha256()
    for chunk in gib_of(block):
        digest.update(chunk)
    sha = digest.hexdigest()
    small = daemon.request("POST", "/v1/blobs", data=b"warm-up", content_type="application/octet-stream")
    assert small.status == 201 and download(daemon, f"/v1/blobs/{small.body['sha256']}") == b"warm-up"
    before = psutil.Process(daemon.pid).memory_info().rss

    with RssWatch(daemon.pid) as uploading:
        conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=120)
        conn.request("POST", "/v1/blobs", gib_of(block), {"Content-Type": "application/octet-stream",
                                                          "Content-Length": str(GIB), "X-Content-SHA256": sha})
        answer = conn.getresponse()
        body = answer.read()
        conn.close()
    assert answer.status == 201, body

    with RssWatch(daemon.pid) as downloading:
        conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=120)
        conn.request("GET", f"/v1/blobs/{sha}")
        response = conn.getresponse()
        assert response.status == 200 and response.headers["Content-Length"] == str(GIB)
        back, size = hashlib.sha256(), 0
        while piece := response.read(MIB):
            back.update(piece)
            size += len(piece)
        conn.close()
    assert (size, back.hexdigest()) == (GIB, sha)
    assert uploading.peak - before <= RSS_GROWTH_MAX, f"upload: RSS {before} -> {uploading.peak}"
    assert downloading.peak - before <= RSS_GROWTH_MAX, f"download: RSS {before} -> {downloading.peak}"


FLEET_PLUGINS = '''
async def shout(ctx):
    """Reads its input where it runs and records it in capitals."""
    data = ctx.inputs["sample"].read_bytes()
    await ctx.artifact("loud.txt", data.upper(), content_type="text/plain")
'''
SAMPLE = b"a sample only the first node was given\n" * 60_000  # past two 1 MiB chunks


def test_on_a_postgresql_fleet_a_file_uploaded_to_one_node_is_the_input_of_a_task_another_runs(fleet: Fleet
                                                                                              ) -> None:
    (fleet.plugins / "fleet_files_plugins.py").write_text(textwrap.dedent(FLEET_PLUGINS))
    shout = {"plugins.shout": {"python": "fleet_files_plugins:shout"}, "types.shout": {"plugins": ["shout"]}}
    front = fleet.add("front", pool={"task_types": ["append"]}, **shout)  # takes submits, never runs a shout
    back = fleet.add("back", **shout)
    fleet.start(front, back)
    uploaded = front.request("POST", "/v1/blobs", data=SAMPLE, content_type="application/octet-stream")
    assert uploaded.status == 201, uploaded
    task_id = front.submit("shout", inputs={"sample": uploaded.body["sha256"]}, max_attempts=1)["id"]
    done = front.wait_terminal(task_id, timeout_s=30)
    assert done["state"] == "completed", (done, back.log())
    assert [a["node_id"] for a in done["attempts"]] == ["back"]
    (artifact,) = done["artifacts"]
    assert artifact["sha256"] == hashlib.sha256(SAMPLE.upper()).hexdigest()
    assert download(front, f"/v1/tasks/{task_id}/artifacts/loud.txt") == SAMPLE.upper()
