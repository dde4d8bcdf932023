"""Scans through a gateway: a gateway and a remote worker as subprocesses over real mutual TLS, the profile's
steps run by the worker, what one step learns carried to the next by the gateway's store, and a scope too
large failing its step as it would on a node of the store."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tidepool.scans import SCOPE_MAX_BYTES

from ..lab import make_lab
from .gateway_helpers import WORKERS, Gateway, running, task, worker_daemon
from .scan_helpers import submit_scan, wait_ended

pytestmark = pytest.mark.timeout(120)

PLUGINS = '''
async def learn(ctx):
    """The first step: learns the open ports of its target, for the steps after it."""
    ctx.scope["open_ports"] = [p for p in ctx.payload["ports"] if p != 22]
    ctx.scope["host"] = ctx.payload["target"]


async def use(ctx):
    """The second step: says what its payload held when it ran (on the worker)."""
    await ctx.emit({"payload": dict(ctx.payload)}, final=True)


async def hoard(ctx):
    """A step that puts far more in its scope than a scan keeps."""
    ctx.scope["dump"] = "x" * ctx.payload["bytes"]
'''


def scan_config(plugins: Path) -> dict[str, dict[str, Any]]:
    """The plugins, types and profiles the gateway (which resolves the profiles) and the worker share."""
    return {
        "plugins.learn": {"python": "gateway_scan_plugins:learn"},
        "plugins.use": {"python": "gateway_scan_plugins:use"},
        "plugins.hoard": {"python": "gateway_scan_plugins:hoard"},
        "types.learn": {"plugins": ["learn"]},
        "types.use": {"plugins": ["use"]},
        "types.hoard": {"plugins": ["hoard"], "max_attempts": 3},
        "profiles.recon": {"steps": ["learn", "use"]},
        "profiles.greedy": {"steps": ["hoard", "use"]},
    }


@pytest.fixture
def gateway_and_worker(tmp_path: Path) -> tuple[Gateway, Any]:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "gateway_scan_plugins.py").write_text(textwrap.dedent(PLUGINS))
    # the plugin module beside whatever tidepool the test itself imports
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(plugins), os.environ.get("PYTHONPATH", "")) if p)}
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab, **scan_config(plugins))
    gateway.env.update(env)
    worker = worker_daemon(tmp_path / "worker", lab, "scan-a", gateway.gateway_url, **scan_config(plugins))
    worker.env.update(env)
    return gateway, worker


def test_a_scan_s_steps_run_on_a_remote_worker_and_the_second_sees_what_the_first_learned(
        gateway_and_worker: tuple[Gateway, Any]) -> None:
    gateway, worker = gateway_and_worker
    with running(gateway, worker):
        started = submit_scan(gateway, "recon", {"target": "10.0.0.7", "ports": [22, 8080]})
        scan = wait_ended(gateway, started["id"], timeout_s=30)
        assert scan["state"] == "succeeded", (scan, worker.log(60))
        assert scan["scope"] == {"open_ports": [8080], "host": "10.0.0.7"}
        learn, use = (task(gateway, job["task_id"]) for job in scan["jobs"])

    assert [learn["node_id"], use["node_id"]] == ["scan-a", "scan-a"]
    assert [[a["node_id"] for a in t["attempts"]] for t in (learn, use)] == [["scan-a"], ["scan-a"]]
    merged = {"target": "10.0.0.7", "ports": [22, 8080], "open_ports": [8080], "host": "10.0.0.7"}
    assert use["payload"] == merged  # the gateway's store wrote the second step's task with the scope merged
    assert [r["payload"] for r in use["results"]] == [{"payload": merged}]  # and the worker ran it as that


def test_a_remote_step_whose_scope_is_too_large_fails_once_and_ends_its_scan(
        gateway_and_worker: tuple[Gateway, Any]) -> None:
    gateway, worker = gateway_and_worker
    with running(gateway, worker):
        started = submit_scan(gateway, "greedy", {"bytes": SCOPE_MAX_BYTES + 1})
        scan = wait_ended(gateway, started["id"], timeout_s=30)
        hoard = task(gateway, scan["jobs"][0]["task_id"])

    assert scan["state"] == "failed", scan
    assert [job["state"] for job in scan["jobs"]] == ["failed", "skipped"]
    assert scan["scope"] == {}
    assert scan["jobs"][0]["error"]["code"] == "scope_too_large"
    # not retried: the same plugin would learn the same; and the worker's ending was taken, not left to expire
    assert [(a["node_id"], a["status"]) for a in hoard["attempts"]] == [("scan-a", "failed")], hoard
