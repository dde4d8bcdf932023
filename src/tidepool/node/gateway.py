"""A node's gateway for remote workers: the worker protocol over this node's store, the watch that tells
its workers of API cancels and of other gateways' notices, and, when gateway.listen is set, the mutual-TLS
listener, whose certificates are read at start and again on each reload; and the node's one waker, which
wakes the gateway's parked acquires with the pool's workers."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from anyio.abc import TaskGroup

from ..events import EventBus
from ..execution.waker import Waker
from ..gateway.listener import serve_gateway
from ..gateway.protocol import Gateway
from ..gateway.tls import Credentials
from ..gateway.watch import Watch
from ..lifecycle import RetryPolicy
from ..settings import Settings
from ..store import Store
from ..store.bounds import RunDeadline


class NodeGateway:
    def __init__(self, store: Store, events: EventBus, settings: Settings,
                 policy: Callable[[], RetryPolicy]) -> None:
        self.gateway = Gateway(store, events, settings=settings.gateway, lease=settings.lease,
                               policy=policy, max_body_kb=settings.api.max_body_kb, deadline=run_deadline(settings),
                               artifacts=settings.artifacts)
        self.watch = Watch(self.gateway)
        events.listen(self.watch.on_event)
        self.credentials: Credentials | None = None  # the listener's TLS, when it listens

    def read_credentials(self, settings: Settings) -> None:
        self.credentials = Credentials(settings.gateway) if settings.gateway.listen else None

    async def start(self, tg: TaskGroup, settings: Settings) -> None:
        """The watch and the listener, when this node listens: bound before the pool starts, as the API is."""
        if self.credentials is not None:
            await tg.start(self.watch.run)
            await tg.start(partial(serve_gateway, self.gateway, self.credentials, settings.gateway.listen,
                                   pool_workers=settings.pool.max_workers))

    def configure(self, new: Settings) -> None:
        self.gateway.configure(new.gateway, new.lease, run_deadline(new), new.artifacts)
        if self.credentials is not None:  # new connections get the files' certificates; live ones keep theirs
            self.credentials.reload(new.gateway)


def run_deadline(settings: Settings) -> RunDeadline:
    """The run deadline of the attempts this node hands out, from its own task types, execution and lease."""
    timeouts = tuple((name, t.timeout_s) for name, t in settings.all_types.items() if t.timeout_s is not None)
    return RunDeadline(settings.execution.timeout_s, settings.execution.stop_timeout_s, settings.lease.duration_s,
                       timeouts)


class WakerWithGateway(Waker):
    """The node's waker, which wakes the gateway's parked acquires as well as the pool's sleeping workers:
    every place that makes work claimable (a submit, a promoted retry, a schedule's tick, another node's
    submit heard from the store) already wakes it."""

    def __init__(self, also: Callable[[int], object]) -> None:
        super().__init__()
        self._also = also

    def wake(self, n: int = 1) -> None:
        super().wake(n)
        self._also(n)
