"""A gateway daemon as a subprocess (its /v1 API with a token, its /w1 listener on mutual TLS, the certificates of
a test lab made for WORKERS) and remote workers that speak the raw /w1 protocol to it, so the registry holds the
records an operator then sees and changes. The `gateway` fixture (in conftest.py) starts one."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidepool.gateway import pki

from ..w1_client import Answer, Remote, client_context

if TYPE_CHECKING:
    from .conftest import Daemon

WORKERS = ("scanner-a", "scanner-b")


@dataclass
class Gateway:
    daemon: Daemon
    lab: pki.Lab
    w1_port: int

    def worker(self, name: str) -> RemoteWorker:
        return RemoteWorker(Remote(f"https://127.0.0.1:{self.w1_port}", client_context(self.lab, name)))

    def record(self, name: str) -> dict[str, Any]:
        answer = self.daemon.get(f"/v1/workers/{name}")
        assert answer.status == 200, answer
        record: dict[str, Any] = answer.body
        return record


@dataclass
class RemoteWorker:
    """One remote worker of the gateway, each of its calls on a connection of its own."""

    remote: Remote

    def acquire(self, *, types: tuple[str, ...] = ("sleep",), most: int = 1) -> Answer:
        """An acquire that answers at once: the worker's first contact enrolls it."""
        return self.remote.call("/w1/acquire", {"types": list(types), "slots": [], "max": most, "wait_s": 0,
                                                "request_id": uuid.uuid4().hex})
