"""The gateway at scale: a load client in this process holds many parked acquires from many identities.

Each identity has a certificate of the lab's CA and its own keep-alive TLS session; each of its acquires
asks for one noop task with the wait a remote worker asks (25 s, which the gateway clips to its
max_wait_s), and asks again as soon as it is answered. A lease it is handed is ended at once (a
`succeeded` finish) and the acquire parked again. The acquires are first opened at an even pace over
one hold, so that, as in a fleet, they come back at their own times and not all together: the gateway's
CPU is then measured while about parked / hold acquires a second are answered empty and parked again.
"""

from __future__ import annotations

import asyncio
import io
import json
import ssl
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil

from tidepool.gateway import pki

PARK_S = 25.0  # what a remote worker asks of the gateway


@dataclass
class Pickups:
    """Tasks the load client was handed, by task id: when (perf_counter) the lease arrived."""

    leased_at: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, asyncio.Event] = field(default_factory=dict)

    def leased(self, task_id: str) -> None:
        self.leased_at[task_id] = time.perf_counter()
        if (event := self.waiting.get(task_id)) is not None:
            event.set()

    async def wait(self, task_id: str, timeout_s: float) -> float:
        if task_id not in self.leased_at:
            event = self.waiting.setdefault(task_id, asyncio.Event())
            await asyncio.wait_for(event.wait(), timeout_s)
        return self.leased_at[task_id]


def tls_for(lab: pki.Lab, name: str) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(lab.ca_file))
    issued = lab.workers[name]
    context.load_cert_chain(str(issued.cert), str(issued.key))
    return context


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    raw = io.BytesIO(json.dumps(body).encode())
    async with session.post(url, data=raw, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


class LoadClient:
    """`per_identity` parked acquires for each identity of `names`, against the gateway at `w1`."""

    def __init__(self, lab: pki.Lab, names: Sequence[str], w1: str, *, per_identity: int) -> None:
        self.lab, self.names, self.w1, self.per_identity = lab, list(names), w1, per_identity
        self.pickups = Pickups()
        self.errors: list[str] = []
        self.answered = 0  # acquires answered (empty or not)
        self.in_flight = 0  # acquires sent and not answered yet: the parked ones, once settled
        self._sessions: list[aiohttp.ClientSession] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, ramp_s: float) -> None:
        """Open every acquire, at an even pace over ramp_s; returns once all were sent."""
        total = len(self.names) * self.per_identity
        sessions = []
        for name in self.names:
            connector = aiohttp.TCPConnector(ssl=tls_for(self.lab, name), limit=0, keepalive_timeout=60.0)
            sessions.append(aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)))
        self._sessions = sessions
        started = time.perf_counter()
        for k in range(total):  # identities in turn, so that each one's acquires are spread over the ramp
            delay = started + ramp_s * k / total - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self._tasks.append(asyncio.create_task(self._loop(sessions[k % len(sessions)])))

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                self.in_flight += 1
                try:
                    status, body = await post(session, self.w1 + "/w1/acquire",
                                              {"types": ["noop"], "max": 1, "wait_s": PARK_S,
                                               "request_id": uuid.uuid4().hex})
                finally:
                    self.in_flight -= 1
                self.answered += 1
                if status != 200:
                    raise RuntimeError(f"acquire answered {status}: {body}")
                for lease in body["tasks"]:
                    self.pickups.leased(lease["task"]["id"])
                    ending = {"attempt_id": lease["attempt_id"], "lease_token": lease["lease_token"],
                              "status": "succeeded"}
                    status, answer = await post(session, self.w1 + "/w1/finish", {"endings": [ending]})
                    if status != 200:
                        raise RuntimeError(f"finish answered {status}: {answer}")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # kept and reported; this acquire stops
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for session in self._sessions:
            await session.close()


async def cpu_percent(process: psutil.Process, window_s: float) -> float:
    """The process's CPU (user + system, all its threads) over the next window_s, in % of one core; the
    load client's acquires go on meanwhile."""
    before, started = process.cpu_times(), time.perf_counter()
    await asyncio.sleep(window_s)
    after, elapsed = process.cpu_times(), time.perf_counter() - started
    return 100 * ((after.user - before.user) + (after.system - before.system)) / elapsed
