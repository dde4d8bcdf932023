"""A remote worker's schedules: its gateway's, fired where the queue is, so each verb refuses here with
RemoteNode, naming the gateway to ask instead."""

from __future__ import annotations

from ...errors import RemoteNode
from ...schedules import Fired, Schedule


async def save_schedule(gateway_url: str) -> Schedule:
    raise RemoteNode(gateway_url)


async def list_schedules(gateway_url: str) -> list[Schedule]:
    raise RemoteNode(gateway_url)


async def delete_schedule(gateway_url: str) -> None:
    raise RemoteNode(gateway_url)


async def pause_schedule(gateway_url: str) -> Schedule:
    raise RemoteNode(gateway_url)


async def fire_schedules(gateway_url: str) -> list[Fired]:
    raise RemoteNode(gateway_url)
