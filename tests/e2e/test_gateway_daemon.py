"""A gateway as the real daemon (`python -m tidepool run`, SQLite store): remote workers reach it over mutual TLS
with certificates made by `tidepool pki` in the test; the operator enables and revokes them on /v1."""

from __future__ import annotations

import json
import signal
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tidepool.gateway import pki

from .conftest import Daemon, Response, free_port


def w1_call(url: str, context: ssl.SSLContext, path: str, body: Any) -> Response:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(request, timeout=10) as answer:
            return Response(answer.status, json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        with exc:
            return Response(exc.code, json.loads(exc.read()))


@pytest.mark.e2e
def test_a_gateway_daemon_serves_enabled_remote_workers_and_refuses_the_others(
        make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    lab = pki.make_lab(tmp_path / "pki", workers=["scanner-1"])
    port = free_port()
    gateway = make_daemon({
        "pool": {"task_types": ["none-here"]},
        "gateway": {"listen": f"127.0.0.1:{port}", "cert_file": str(lab.gateway.cert),
                    "key_file": str(lab.gateway.key), "client_ca_file": str(lab.ca_file)}})
    gateway.start()
    url = f"https://127.0.0.1:{port}"
    context = ssl.create_default_context(cafile=str(lab.ca_file))
    context.load_cert_chain(lab.workers["scanner-1"].cert, lab.workers["scanner-1"].key)
    acquire = {"types": ["noop"], "max": 4, "wait_s": 0}
    task = gateway.submit("noop")

    pending = w1_call(url, context, "/w1/acquire", acquire)
    assert (pending.status, pending.error["code"]) == (403, "worker_pending")
    with pytest.raises(OSError):  # no client certificate: the handshake fails (URLError, or a reset in TLS 1.3)
        w1_call(url, ssl.create_default_context(cafile=str(lab.ca_file)), "/w1/acquire", acquire)

    assert gateway.request("PATCH", "/v1/workers/scanner-1", {"state": "enabled"}).status == 200
    gateway.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]  # certificates read again, nothing dropped
    acquired = w1_call(url, context, "/w1/acquire", acquire)
    assert acquired.status == 200, acquired
    (lease,) = acquired.body["tasks"]
    assert lease["task"]["id"] == task["id"]
    held = {"attempt_id": lease["attempt_id"], "lease_token": lease["lease_token"]}
    ended = w1_call(url, context, "/w1/finish", {"endings": [{**held, "status": "succeeded"}]})
    assert ended.body["endings"][0]["state"] == "completed"
    done = gateway.task(task["id"])
    assert (done["state"], done["node_id"]) == ("completed", "scanner-1")

    metrics = gateway.request("GET", "/metrics").body
    assert 'tidepool_gateway_leases_total 1.0' in metrics
    assert 'tidepool_gateway_acquires_answered_total{outcome="leased"} 1.0' in metrics
    assert 'tidepool_gateway_writes_refused_total{reason="pending"} 1.0' in metrics

    assert gateway.post("/v1/workers/scanner-1/revoke").status == 202
    revoked = w1_call(url, context, "/w1/acquire", acquire)
    assert (revoked.status, revoked.error["code"]) == (403, "worker_revoked")
    doc = gateway.get("/v1/openapi.json").body
    assert doc["paths"]["/w1/acquire"]["post"]["tags"] == ["worker protocol"]
    assert gateway.stop() == 0
    assert "worker scanner-1 enabled -> revoked" in gateway.log(400)
