"""A gateway as the real daemon (`python -m tidepool run`, SQLite store): remote workers reach it over mutual TLS
with the certificates of a test lab; the operator enables and revokes them on /v1."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from ..lab import gateway_section, make_lab
from ..w1_client import Remote, client_context
from .conftest import Daemon, free_port


@pytest.mark.e2e
def test_a_gateway_daemon_serves_enabled_remote_workers_and_refuses_the_others(
        make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    lab = make_lab(tmp_path, ["scanner-1"])
    port = free_port()
    gateway = make_daemon({
        "pool": {"task_types": ["none-here"]},
        "gateway": gateway_section(lab, listen=f"127.0.0.1:{port}")})
    gateway.start()
    url = f"https://127.0.0.1:{port}"
    worker = Remote(url, client_context(lab, "scanner-1"))
    acquire = {"types": ["noop"], "max": 4, "wait_s": 0}
    task = gateway.submit("noop")

    pending = worker.call("/w1/acquire", acquire)
    assert (pending.status, pending.error["code"]) == (403, "worker_pending")
    with pytest.raises(OSError):  # no client certificate: the handshake fails (an SSL error, or a reset in TLS 1.3)
        Remote(url, client_context(lab, None)).call("/w1/acquire", acquire)

    assert gateway.request("PATCH", "/v1/workers/scanner-1", {"state": "enabled"}).status == 200
    gateway.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]  # certificates read again, nothing dropped
    acquired = worker.call("/w1/acquire", acquire)
    assert acquired.status == 200, acquired
    (lease,) = acquired.body["tasks"]
    assert lease["task"]["id"] == task["id"]
    held = {"attempt_id": lease["attempt_id"], "lease_token": lease["lease_token"]}
    ended = worker.call("/w1/finish", {"endings": [{**held, "status": "succeeded"}]})
    assert ended.body["endings"][0]["state"] == "completed"
    done = gateway.task(task["id"])
    assert (done["state"], done["node_id"]) == ("completed", "scanner-1")

    metrics = gateway.request("GET", "/metrics").body
    assert 'tidepool_gateway_leases_total 1.0' in metrics
    assert 'tidepool_gateway_acquires_answered_total{outcome="leased"} 1.0' in metrics
    assert 'tidepool_gateway_writes_refused_total{reason="pending"} 1.0' in metrics

    assert gateway.post("/v1/workers/scanner-1/revoke").status == 202
    revoked = worker.call("/w1/acquire", acquire)
    assert (revoked.status, revoked.error["code"]) == (403, "worker_revoked")
    doc = gateway.get("/v1/openapi.json").body
    assert doc["paths"]["/w1/acquire"]["post"]["tags"] == ["worker protocol"]
    assert gateway.stop() == 0
    assert "worker scanner-1 enabled -> revoked" in gateway.log(400)
