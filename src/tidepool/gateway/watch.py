"""The watch: what the gateway follows while it runs. Cancels asked through the API reach the control stream
of the remote worker that runs the task at once, so do the cancels and registry changes other gateways of a
shared store make (its notices), and the registry's counts for the metrics stay fresh."""

from __future__ import annotations

import logging
from collections import deque

import anyio
from anyio.abc import TaskStatus

from ..errors import TidepoolError
from ..events import Event
from ..model import AttemptStatus
from ..store.notices import Notice, NoticeKind, NoticeSource
from .protocol import Gateway

log = logging.getLogger("tidepool.gateway")
COUNT_EVERY_S = 10.0
LIVE = (AttemptStatus.LEASED, AttemptStatus.RUNNING)


class Watch:
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._unknown: deque[str] = deque(maxlen=10_000)  # cancelled tasks whose attempt the gateway does not know
        self._more = anyio.Event()
        if isinstance(gateway.store, NoticeSource):
            gateway.store.hear_notices(self.heard)

    def heard(self, notice: Notice) -> None:
        """Another process of the store cancelled a remote attempt or changed a worker's record."""
        if notice.kind is NoticeKind.CANCEL and notice.attempt_id is not None:
            self._gateway.controls.cancel(notice.worker_id, notice.attempt_id)
        elif notice.kind is NoticeKind.WORKER and notice.state is not None:
            self._gateway.registry.heard_change(notice.worker_id, notice.state)

    def on_event(self, event: Event) -> None:
        """The event bus listener: a cancel of a task leased to a remote worker is told to that worker."""
        if event.name != "task.cancel_requested" or event.data.get("attempt_id") is not None:
            return  # a revoke's cancels name their attempt and have been told already
        task_id = event.data["task_id"]
        found = self._gateway.attempts.of_task(task_id)
        if found is not None:
            attempt_id, attempt = found
            self._gateway.controls.cancel(attempt.identity, attempt_id)
        elif self._gateway.controls.open_streams():
            self._unknown.append(task_id)
            self._more.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            with anyio.move_on_after(COUNT_EVERY_S):
                await self._more.wait()
            self._more = anyio.Event()
            while self._unknown:
                await self._tell(self._unknown.popleft())
            try:
                await self._gateway.registry.list_workers()  # counts the workers by state as it reads them
            except TidepoolError as exc:
                log.debug("gateway: cannot count the workers: %s", exc)

    async def _tell(self, task_id: str) -> None:
        """A cancelled task another gateway (or an earlier process) leased: its live attempt's owner hears it."""
        try:
            task = await self._gateway.store.get(task_id)
        except TidepoolError:
            return
        for attempt in task.attempts:
            if attempt.status in LIVE:
                self._gateway.controls.cancel(attempt.node_id, attempt.id)
