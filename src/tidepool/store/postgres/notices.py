"""The notices of the PostgreSQL store (store/notices.py): sent on the schema's NOTIFY channel beside the
wake-ups, inside the transaction of the change they tell of, and heard on each node's LISTEN connection.

A payload is `ORIGIN cancel ATTEMPT WORKER` or `ORIGIN worker STATE WORKER`: the worker's identity comes last,
as it may hold spaces. ORIGIN names the process that sent it, which acts on its own changes in memory and
skips its notices. A wake-up's payload is a number, so the two never mix, and a node of an older version
takes a notice for one wake-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...model import RemoteWorker, new_token
from ..notices import Notice, NoticeKind
from ..port import Revoked
from ..rules import REMOTE_INSTANCE
from .connection import Conn
from .statements import SQL


class Notices:
    def __init__(self) -> None:
        self.origin = new_token()[:16]
        self._heard: Callable[[Notice], None] | None = None

    def hear(self, heard: Callable[[Notice], None]) -> None:
        self._heard = heard

    # sending, inside the caller's transaction

    async def remote_cancel(self, conn: Conn, task_id: str) -> None:
        """A cancel of `task_id`: told only if a remote worker holds it."""
        await conn.execute(SQL["notify_remote_cancel"], task_id, self.origin, REMOTE_INSTANCE)

    async def worker_changed(self, conn: Conn, worker: RemoteWorker, cancelled: Sequence[Revoked]) -> None:
        """The cancels a change made first, then the record's change: a revoke's last frame ends the stream."""
        payloads = [f"{self.origin} cancel {r.attempt_id} {worker.id}" for r in cancelled]
        payloads.append(f"{self.origin} worker {worker.state.value} {worker.id}")
        await conn.execute(SQL["notify_all"], payloads)

    # hearing

    def heard(self, payload: str) -> bool:
        """Whether `payload` was a notice (acted on unless this process sent it); False: a wake-up's."""
        parts = payload.split(" ", 3)
        if len(parts) != 4 or parts[1] not in ("cancel", "worker"):
            return False
        origin, kind, detail, worker_id = parts
        if origin == self.origin or self._heard is None:
            return True
        if kind == "cancel":
            notice = Notice(NoticeKind.CANCEL, worker_id, attempt_id=detail)
        else:
            notice = Notice(NoticeKind.WORKER, worker_id, state=detail)
        self._heard(notice)
        return True
