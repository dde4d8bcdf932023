"""A remote worker's node, where it differs from any node: its API refuses the queue's routes (the queue is
its gateway's), and its lease keeper takes the gateway's terms and its stops. Pool, engine, plugins,
resources, guards and lease keeper are the same parts as on any node."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator

from ..api.operations import NodesView, ScheduleView
from ..errors import RemoteNode
from ..execution.leases import LeaseKeeper
from ..execution.waker import Waker
from ..model import Artifact, Blob, NewTask, State, Task
from ..plugins import command
from ..schedules import Schedule
from ..settings import redacted_url
from ..store import Page
from ..store.remote import LeaseTerms, RemoteStore
from .operations import NodeOperations

REVOKED_KILL_S = 0.2  # a revoked worker's commands get SIGKILL this soon, whatever their kill_grace_s


def attach_remote(store: RemoteStore, leases: LeaseKeeper, waker: Waker) -> None:
    """The gateway's cancels and revoke stop the keeper's attempts; its lease terms are the keeper's."""
    def terms(t: LeaseTerms) -> None:
        leases.configure(lease_s=t.lease_s, renew_every_s=t.renew_after_s)

    store.attach(held=leases.held, on_terms=terms, wake_max=waker.wake_max,
                 on_revoked=lambda: command.hurry(time.monotonic() + REVOKED_KILL_S))


class RemoteOperations(NodeOperations):
    """A remote worker's API: pool, probes, metrics and events as any node's; tasks and schedules answer
    409 remote_worker, naming the gateway, where the node would ask its store."""

    def _gateway(self) -> RemoteNode:
        return RemoteNode(redacted_url(self._settings.store.url))

    async def submit(self, new: NewTask) -> tuple[Task, bool]:
        raise self._gateway()

    async def submit_many(self, news: list[NewTask]) -> list[tuple[str, bool]]:
        raise self._gateway()

    async def get(self, task_id: str) -> Task:
        raise self._gateway()

    async def list_tasks(self, *, state: State | None, type: str | None, limit: int, cursor: str | None,
                         organization: str | None = None) -> Page:
        raise self._gateway()

    async def cancel(self, task_id: str) -> State:
        raise self._gateway()

    async def retry(self, task_id: str) -> Task:
        raise self._gateway()

    async def nodes_view(self) -> NodesView:
        raise self._gateway()

    async def put_blob(self, chunks: AsyncIterable[bytes], *, expect: str | None = None) -> tuple[Blob, bool]:
        raise self._gateway()

    async def get_blob(self, sha256: str) -> Blob:
        raise self._gateway()

    async def read_blob(self, sha256: str, *, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        raise self._gateway()
        yield b""  # an async generator, as the node's read_blob answers one

    async def list_artifacts(self, task_id: str) -> list[Artifact]:
        raise self._gateway()

    async def schedules_view(self) -> list[ScheduleView]:
        raise self._gateway()

    async def save_schedule(self, schedule: Schedule) -> Schedule:
        raise self._gateway()

    async def delete_schedule(self, name: str) -> None:
        raise self._gateway()

    async def pause_schedule(self, name: str, *, paused: bool) -> Schedule:
        raise self._gateway()
