"""A gateway and its remote workers as `tidepool run` subprocesses, with the certificates of a test lab made
for WORKERS; a TCP proxy that can stop forwarding (a partition)."""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tidepool.gateway import pki

from ..lab import gateway_section
from .conftest import TERMINAL, Daemon, free_port, merge

WORKERS = ("scan-a", "scan-b", "scan-c")


class Gateway(Daemon):
    """A node that serves the worker protocol on its own TLS port (`gateway_url`); its own pool runs nothing.
    Expired and failed attempts are retried at once, so that a test sees the task run again without waiting."""

    def __init__(self, root: Path, lab: pki.Lab, **sections: dict[str, Any]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.gateway_port = free_port()
        self.gateway_url = f"https://127.0.0.1:{self.gateway_port}"
        super().__init__(root, merge({
            "node": {"id": "gateway"},
            "gateway": gateway_section(lab, listen=f"127.0.0.1:{self.gateway_port}", enroll="auto"),
            "pool": {"task_types": [], "drain_timeout_s": 2.0},
            "lease": {"duration_s": 4.0, "renew_every_s": 1.0},
            "retry": {"backoff_base_s": 0.0},
            "reconciler": {"interval_s": 0.2},
        }, sections))


def worker_daemon(root: Path, lab: pki.Lab, name: str, gateway_url: str, **sections: dict[str, Any]) -> Daemon:
    """A remote worker whose node id is its certificate's name."""
    issued = lab.workers[name]
    root.mkdir(parents=True, exist_ok=True)
    return Daemon(root, merge({
        "node": {"id": name},
        "store": {"url": gateway_url, "cert_file": str(issued.cert), "key_file": str(issued.key),
                  "ca_file": str(lab.ca_file)},
        "pool": {"min_workers": 1, "max_workers": 4, "drain_timeout_s": 2.0, "poll_interval_s": 5.0},
    }, sections))


def wait_for(condition: Callable[[], Any], *, timeout_s: float = 20.0, what: str = "the condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def task(gateway: Daemon, task_id: str) -> dict[str, Any]:
    answer = gateway.request("GET", f"/v1/tasks/{task_id}")
    assert answer.status == 200, answer
    body: dict[str, Any] = answer.body
    return body


def ended(gateway: Daemon, task_id: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
    body: dict[str, Any] = wait_for(lambda: (t := task(gateway, task_id))["state"] in TERMINAL and t,
                                    timeout_s=timeout_s, what=f"task {task_id} ending")
    return body


def submit(gateway: Daemon, task_type: str, payload: dict[str, Any] | None = None, **fields: Any) -> str:
    answer = gateway.request("POST", "/v1/tasks", {"type": task_type, "payload": payload or {}, **fields})
    assert answer.status == 201, answer
    task_id: str = answer.body["id"]
    return task_id


def lease_of(gateway: Daemon, task_id: str) -> tuple[str, str]:
    """The attempt id and worker token of the task's live lease, read from the gateway's SQLite file."""
    with contextlib.closing(sqlite3.connect(gateway.db_path)) as db:
        attempt_id, token = db.execute("SELECT lease_attempt_id, lease_token FROM tasks WHERE id = ?",
                                       (task_id,)).fetchone()
    return attempt_id, f"{task_id}.{token}"


class Proxy:
    """Forwards 127.0.0.1:port to a target; cut() stops forwarding both ways (connections stay open and
    hear nothing, new ones are accepted and go nowhere), as a network partition does; mend() undoes it."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._forwarding.clear()

    def mend(self) -> None:
        self._forwarding.set()

    def close(self) -> None:
        self._closed = True
        self._forwarding.set()
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(client)
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._forwarding.wait()  # cut: an accepted connection waits, and hears nothing
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        self._sockets.append(upstream)
        threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
        self._pump(upstream, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self._forwarding.is_set():
                    continue  # cut: what is sent is lost
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def running(*daemons: Daemon) -> Iterator[None]:
    """Each daemon started in turn, all stopped on the way out (the workers before their gateway)."""
    started: list[Daemon] = []
    try:
        for daemon in daemons:
            daemon.start()
            started.append(daemon)
        yield
    finally:
        for daemon in reversed(started):
            daemon.stop()
