"""A gateway daemon as a subprocess (its /v1 API with a token, its /w1 listener on mutual TLS, certificates made
by tidepool's lab CA for the test) and remote workers that speak the raw /w1 protocol to it, so the registry
holds the records an operator then sees and changes."""

from __future__ import annotations

import http.client
import json
import ssl
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tidepool.gateway import pki

from .conftest import TOKEN, Daemon, free_port

WORKERS = ("scanner-a", "scanner-b")


@dataclass
class Gateway:
    daemon: Daemon
    lab: pki.Lab
    w1_port: int

    def worker(self, name: str) -> RawWorker:
        return RawWorker(self, name)

    def record(self, name: str) -> dict[str, Any]:
        answer = self.daemon.get(f"/v1/workers/{name}")
        assert answer.status == 200, answer
        record: dict[str, Any] = answer.body
        return record


class RawWorker:
    """One remote worker's calls, each on a connection of its own with the worker's client certificate."""

    def __init__(self, gateway: Gateway, name: str) -> None:
        issued = gateway.lab.workers[name]
        self.context = ssl.create_default_context(cafile=str(gateway.lab.ca_file))
        self.context.load_cert_chain(issued.cert, issued.key)
        self.port = gateway.w1_port

    def call(self, path: str, body: Any) -> tuple[int, Any]:
        conn = http.client.HTTPSConnection("localhost", self.port, context=self.context, timeout=10)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            conn.close()

    def acquire(self, *, types: tuple[str, ...] = ("sleep",), most: int = 1) -> tuple[int, Any]:
        """An acquire that answers at once: the worker's first contact enrolls it."""
        return self.call("/w1/acquire", {"types": list(types), "slots": [], "max": most, "wait_s": 0,
                                         "request_id": uuid.uuid4().hex})


@pytest.fixture
def gateway(make_token_daemon: Callable[..., Daemon], tmp_path: Path) -> Gateway:
    """A gateway (manual enrollment) whose own pool takes none of the tasks: its remote workers lease them."""
    lab = pki.make_lab(tmp_path / "pki", workers=WORKERS)
    w1_port = free_port()
    daemon = make_token_daemon({
        "pool": {"task_types": ["local-only"]},
        "gateway": {"listen": f"127.0.0.1:{w1_port}", "cert_file": str(lab.gateway.cert),
                    "key_file": str(lab.gateway.key), "client_ca_file": str(lab.ca_file)},
    })
    daemon.token = TOKEN
    return Gateway(daemon, lab, w1_port)
