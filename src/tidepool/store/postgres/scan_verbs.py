"""The PostgreSQL store's scan verbs, each a transaction of its own (what they do is scans.py's).

finish_cancels and fail_unserviceable leave their steps' scans to advance_scans, which the reconciler runs
right after them.
"""

from __future__ import annotations

from typing import Any, Protocol

from ...scans import NewScan, Scan, ScanState
from ..port import CancelAnswer, ScanCancel, ScanListener, ScanMove, ScanPage
from . import queue, scans
from .connection import Connections

ONE_SNAPSHOT: dict[str, Any] = {"isolation": "repeatable_read", "readonly": True}  # scans and jobs as of one time
SWEEP = 500  # scans moved on per reconciler transaction: bounded locks per step


class _CancelTask(Protocol):
    async def __call__(self, conn: Any, row: Any, task_id: str, now: float, moves: scans.Moves) -> CancelAnswer: ...


class ScanVerbs:
    _db: Connections
    _told: scans.Told
    _cancel_locked: _CancelTask

    async def add_scan(self, new: NewScan, *, now: float, max_queued: int | None = None) -> tuple[Scan, bool]:
        async with self._db.conn() as conn, conn.transaction():
            return await scans.add_scan(conn, new, now, max_queued)

    async def get_scan(self, scan_id: str) -> Scan:
        async with self._db.conn() as conn, conn.transaction(**ONE_SNAPSHOT):
            return await scans.read(conn, scan_id)

    async def list_scans(self, *, state: ScanState | None = None, profile: str | None = None, limit: int = 50,
                         cursor: str | None = None) -> ScanPage:
        async with self._db.conn() as conn, conn.transaction(**ONE_SNAPSHOT):
            return await scans.list_scans(conn, state=state, profile=profile, limit=limit, cursor=cursor)

    async def cancel_scan(self, scan_id: str, *, now: float) -> ScanCancel:
        moves: scans.Moves = []
        async with self._db.conn() as conn, conn.transaction():
            answer = await scans.cancel(conn, scan_id, now, moves, lock_task=scans.locked_task,
                                        cancel_task=self._cancel_locked)
        self._told(moves)
        return answer

    async def retry_job(self, scan_id: str, index: int, *, now: float, max_queued: int | None = None) -> Scan:
        async with self._db.conn() as conn, conn.transaction():
            if max_queued is not None:
                await queue.check_queue_room(conn, 1, max_queued)
            return await scans.retry_job(conn, scan_id, index, now)

    async def advance_scans(self, *, now: float) -> list[ScanMove]:
        told: list[ScanMove] = []
        while True:
            moves: scans.Moves = []
            async with self._db.conn(rows=SWEEP) as conn, conn.transaction():
                found = await scans.stalled(conn, SWEEP)
                for scan_id in found:
                    scan = await scans.stored(conn, scan_id)
                    if scan is not None:
                        await scans.advance(conn, moves, scan, now)
            self._told(moves)
            told.extend(moves)
            if len(found) < SWEEP:
                return told

    def on_scan_moves(self, listener: ScanListener | None) -> None:
        self._told.listener = listener
