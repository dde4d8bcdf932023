"""A remote worker's tasks: the queue's, kept by its gateway, so each verb refuses with RemoteNode (409
remote_worker on the worker's own API, naming the gateway to ask instead) and none is counted here."""

from __future__ import annotations

from ...errors import RemoteNode
from ...model import State, Task
from ..port import CancelAnswer, Page


async def add(gateway_url: str) -> tuple[Task, bool]:
    raise RemoteNode(gateway_url)


async def add_many(gateway_url: str) -> list[tuple[str, bool]]:
    raise RemoteNode(gateway_url)


async def get(gateway_url: str) -> Task:
    raise RemoteNode(gateway_url)


async def list_tasks(gateway_url: str) -> Page:
    raise RemoteNode(gateway_url)


async def counts() -> dict[State, int]:
    """The queue is the gateway's: none of it is counted here."""
    return {}


async def organization_counts() -> dict[str, int]:
    return {}


async def request_cancel(gateway_url: str) -> CancelAnswer:
    raise RemoteNode(gateway_url)


async def retry(gateway_url: str) -> Task:
    raise RemoteNode(gateway_url)
