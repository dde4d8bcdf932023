"""A remote worker's upkeep: the reconciler's passes and the fleet of nodes are its gateway's, so each pass
refuses here with RemoteNode, and this host neither saves nor locks a node row."""

from __future__ import annotations

from ...errors import RemoteNode
from ..port import Ended, Expired, Node


async def expire_leases(gateway_url: str) -> list[Expired]:
    raise RemoteNode(gateway_url)


async def promote_due(gateway_url: str) -> int:
    raise RemoteNode(gateway_url)


async def finish_cancels(gateway_url: str) -> list[Ended]:
    raise RemoteNode(gateway_url)


async def prune(gateway_url: str) -> int:
    raise RemoteNode(gateway_url)


async def queued_tag_sets(gateway_url: str) -> list[frozenset[str]]:
    raise RemoteNode(gateway_url)


async def fail_unserviceable(gateway_url: str) -> list[Ended]:
    raise RemoteNode(gateway_url)


async def save_node() -> None:
    """Nothing to save: the gateway's registry hears of this worker from its acquires and renewals."""


async def lock_node() -> None:
    """The gateway knows this worker by its certificate; this host's lock file keeps it one process."""


async def list_nodes(gateway_url: str) -> list[Node]:
    raise RemoteNode(gateway_url)
