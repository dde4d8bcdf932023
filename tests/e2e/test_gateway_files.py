"""Files through a gateway: a gateway and a remote worker as subprocesses over real mutual TLS; the task's input
fetched by the worker from GET /w1/blobs into its cache, and what its plugin writes recorded as an artifact
with PUT /w1/artifacts, then read back from the gateway's API."""

from __future__ import annotations

import hashlib
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ..lab import make_lab
from .gateway_helpers import WORKERS, Gateway, ended, running, submit, worker_daemon

pytestmark = pytest.mark.timeout(120)

PLUGINS = '''
async def shout(ctx):
    """Reads its input on the worker and records it in capitals."""
    data = ctx.inputs["sample"].read_bytes()
    await ctx.artifact("loud.txt", data.upper(), content_type="text/plain")
'''
SAMPLE = b"a sample the worker has never seen\n" * 40_000  # past one 1 MiB chunk


def config(plugins: Path) -> dict[str, dict[str, Any]]:
    return {"plugins.shout": {"python": "gateway_files_plugins:shout"}, "types.shout": {"plugins": ["shout"]}}


def test_a_remote_worker_runs_a_task_with_an_input_and_records_its_artifact(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "gateway_files_plugins.py").write_text(textwrap.dedent(PLUGINS))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(plugins), os.environ.get("PYTHONPATH", "")) if p)}
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab, **config(plugins))
    gateway.env.update(env)
    worker = worker_daemon(tmp_path / "worker", lab, "scan-a", gateway.gateway_url, **config(plugins))
    worker.env.update(env)
    with running(gateway, worker):
        uploaded = gateway.request("POST", "/v1/blobs", data=SAMPLE, content_type="application/octet-stream")
        assert uploaded.status == 201, uploaded
        sample = uploaded.body["sha256"]
        task_id = submit(gateway, "shout", inputs={"sample": sample}, max_attempts=1)
        done = ended(gateway, task_id)
        assert done["state"] == "completed", (done, worker.log(60))
        (artifact,) = done["artifacts"]
        assert (artifact["name"], artifact["content_type"]) == ("loud.txt", "text/plain")
        assert artifact["sha256"] == hashlib.sha256(SAMPLE.upper()).hexdigest()
        assert done["attempts"][0]["node_id"] == "scan-a"
    cached = worker.state_dir / "cache" / sample
    assert cached.read_bytes() == SAMPLE  # kept for the next task that names it
