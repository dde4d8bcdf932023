"""A remote worker's standing in its gateway's registry (enabled, disabled, revoked, pending), as the last
answer or the control stream said it, and that control stream: followed, acted on at once, reconnected
with jittered backoff whenever it drops.

The registry itself is the gateway's: its verbs refuse here with RemoteNode, naming the gateway to ask."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import aiohttp
import anyio
from anyio.abc import TaskStatus

from ...errors import RemoteNode, StoreUnavailable
from ...logs import Outage
from ...model import RemoteWorker
from ..port import Acquired, Revoked
from .database import RECONNECT, Answer, Refusal, Wire, checked, log, parse_json, reason

CONTROL_IDLE_S = 45.0  # no byte (event or heartbeat comment) for this long: the stream is dead, reconnect
STABLE_S = 5.0  # a stream up this long starts the backoff again; one dropped sooner keeps backing off


class Standing:
    """This worker's state in the gateway's registry, as last heard; acts on each change once."""

    def __init__(self, *, on_enabled: Callable[[], None], on_revoked: Callable[[], None]) -> None:
        self.state = "enabled"  # until the gateway says otherwise: the first acquire asks
        self.stream_up = False
        self._on_enabled = on_enabled
        self._on_revoked = on_revoked

    def heard(self, state: str) -> None:
        if state == self.state or self.state == "revoked":  # revoked is final
            return
        before, self.state = self.state, state
        if state == "revoked":
            log.error("the gateway revoked this worker: every attempt is stopped and nothing more is claimed "
                      "or written; its operator must issue a new identity to bring the host back")
            self._on_revoked()
        elif state == "disabled":
            log.warning("the gateway disabled this worker (a drain): running tasks finish, no new task is "
                        "claimed until it is enabled again")
        elif state == "pending":
            log.warning("the gateway has not enabled this worker yet (enrollment pending): nothing is claimed "
                        "until an operator enables it (tidepool workers enable ID, on the gateway)")
        elif state == "enabled":
            log.info("the gateway enabled this worker (it was %s): claiming", before)
            self._on_enabled()

    def refused(self, error: Refusal) -> None:
        self.heard(error.code.removeprefix("worker_"))

    @property
    def revoked(self) -> bool:
        return self.state == "revoked"

    def may_acquire(self) -> bool:
        """Not once revoked; not while disabled and the control stream is up, which will say when it is
        enabled again (with the stream down, an acquire is how to learn it: a disabled one answers at once)."""
        return not self.revoked and not (self.state == "disabled" and self.stream_up)


class ControlStream:
    """Follows GET /w1/control: `cancel {attempt_id}`, `worker {state}`, `wake {n}`, each acted on as it comes."""

    def __init__(self, wire: Wire, standing: Standing, *, cancel: Callable[[str], None],
                 wake_max: Callable[[], None]) -> None:
        self._wire = wire
        self._standing = standing
        self._cancel = cancel
        self._wake_max = wake_max
        self._outage = Outage(log)
        self._connected_at: float | None = None  # monotonic: when the last try got the stream, if it did

    async def run(self, wake: Callable[[int], None], *,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled, or the worker is revoked. Started at once: a gateway that is away when the node
        starts is reached when it comes back, and the node runs meanwhile."""
        task_status.started()
        delays = RECONNECT.delays()
        while not self._standing.revoked:
            try:
                await self._follow(wake)
                self._outage.failing("control stream of gateway %s ended; reconnecting", self._wire.url)
            except Refusal as exc:
                self._standing.refused(exc)
            except StoreUnavailable as exc:
                self._outage.failing("control stream of gateway %s: %s; reconnecting with backoff",
                                     self._wire.url, exc)
            finally:
                self._standing.stream_up = False
            if self._standing.revoked:
                return
            if self._connected_at is not None and anyio.current_time() - self._connected_at >= STABLE_S:
                delays = RECONNECT.delays()
            await anyio.sleep(next(delays))

    async def _follow(self, wake: Callable[[int], None]) -> None:
        self._connected_at = None
        try:
            async with self._wire.get_stream("/w1/control", idle_s=CONTROL_IDLE_S) as response:
                if response.status != 200:
                    checked(Answer(response.status, parse_json(await response.read())), "/w1/control",
                            self._wire.url)
                    raise StoreUnavailable(f"answered /w1/control with {response.status}")
                self._connected_at, self._standing.stream_up = anyio.current_time(), True
                self._outage.over("control stream of gateway %s connected", self._wire.url)
                self._wake_max()  # wake-ups sent while the stream was down are lost: look now
                async for name, data in sse_events(response.content):
                    self._act(name, data, wake)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise StoreUnavailable(reason(exc)) from None

    def _act(self, name: str, data: dict[str, Any], wake: Callable[[int], None]) -> None:
        if name == "cancel" and isinstance(data.get("attempt_id"), str):
            self._cancel(data["attempt_id"])
        elif name == "worker" and isinstance(data.get("state"), str):
            self._standing.heard(data["state"])
        elif name == "wake":
            n = data.get("n", 1)
            wake(n if isinstance(n, int) and n > 0 else 1)


async def sse_events(content: AsyncIterable[bytes]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(event name, JSON data) of each event of a text/event-stream; comments (heartbeats) and events
    whose data is not a JSON object are passed over."""
    name, data = "message", list[str]()
    async for raw in content:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                try:
                    parsed = json.loads("\n".join(data))
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    yield name, parsed
            name, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)


# the registry's verbs, the gateway's


async def meet_worker(gateway_url: str) -> RemoteWorker:
    raise RemoteNode(gateway_url)


async def list_workers(gateway_url: str) -> list[RemoteWorker]:
    raise RemoteNode(gateway_url)


async def get_worker(gateway_url: str) -> RemoteWorker:
    raise RemoteNode(gateway_url)


async def change_worker(gateway_url: str) -> tuple[RemoteWorker, list[Revoked]]:
    raise RemoteNode(gateway_url)


async def revoke_worker(gateway_url: str) -> tuple[RemoteWorker, list[Revoked]]:
    raise RemoteNode(gateway_url)


async def acquire(gateway_url: str) -> Acquired:
    raise RemoteNode(gateway_url)


async def attempt_owners(gateway_url: str) -> dict[str, str]:
    raise RemoteNode(gateway_url)


async def cancelling_of(gateway_url: str) -> list[str]:
    raise RemoteNode(gateway_url)
