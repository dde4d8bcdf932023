"""A remote worker daemon's plugin against its gateway's result quota, as subprocesses over real TLS: the
gateway refuses the batch past the quota (413 result_quota), the worker's engine fails the attempt saying so,
and the gateway takes its ending."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from ..lab import make_lab
from .gateway_helpers import WORKERS, Gateway, ended, running, submit, worker_daemon

pytestmark = pytest.mark.timeout(120)


def three_commands() -> dict[str, dict[str, Any]]:
    """A type `trio` of three command plugins, each storing one result."""
    plugins = {f"plugins.say{n}": {"command": [sys.executable, "-c", f"print({n})"]} for n in (1, 2, 3)}
    return {**plugins, "types.trio": {"plugins": ["say1", "say2", "say3"], "max_attempts": 3}}


def test_a_remote_plugin_past_its_gateways_result_quota_fails_its_attempt_for_good(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab, **three_commands(), gateway={"max_results_per_attempt": 2})
    # the worker's own quota is far larger: the gateway's is the one that holds
    worker = worker_daemon(tmp_path / "a", lab, "scan-a", gateway.gateway_url, **three_commands())
    with running(gateway, worker):
        body = ended(gateway, submit(gateway, "trio"))
        log = worker.log(200)
    assert body["state"] == "failed", body
    assert body["error"]["code"] == "result_quota"
    assert [(a["node_id"], a["status"]) for a in body["attempts"]] == [("scan-a", "failed")]
    assert [r["plugin"] for r in body["results"]] == ["say1", "say2"]
    assert log.count("over its quota") == 1 and body["id"] in log
