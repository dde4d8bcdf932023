"""A remote worker's scans: its gateway's, their steps' tasks reaching this worker as any task does, so each
verb refuses here with RemoteNode and no scan moves here."""

from __future__ import annotations

from ...errors import RemoteNode
from ...scans import Scan
from ..port import ScanCancel, ScanMove, ScanPage


async def add_scan(gateway_url: str) -> tuple[Scan, bool]:
    raise RemoteNode(gateway_url)


async def get_scan(gateway_url: str) -> Scan:
    raise RemoteNode(gateway_url)


async def list_scans(gateway_url: str) -> ScanPage:
    raise RemoteNode(gateway_url)


async def cancel_scan(gateway_url: str) -> ScanCancel:
    raise RemoteNode(gateway_url)


async def retry_job(gateway_url: str) -> Scan:
    raise RemoteNode(gateway_url)


async def advance_scans() -> list[ScanMove]:
    return []


def on_scan_moves() -> None:
    """No scan moves here: a step's end and its next task are made where the store is."""
