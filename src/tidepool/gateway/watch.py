"""What the gateway follows while it runs: cancels asked through the API reach the control stream of the
remote worker that runs the task at once, and the registry's counts for the metrics stay fresh."""

from __future__ import annotations

import logging
from collections import deque

import anyio
from anyio.abc import TaskStatus

from ..errors import TidepoolError
from ..events import Event
from ..model import AttemptStatus
from .protocol import Gateway

log = logging.getLogger("tidepool.gateway")
COUNT_EVERY_S = 10.0
LIVE = (AttemptStatus.LEASED, AttemptStatus.RUNNING)


class Watch:
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._unknown: deque[str] = deque(maxlen=10_000)  # cancelled tasks whose attempt the book does not hold
        self._more = anyio.Event()

    def on_event(self, event: Event) -> None:
        """The event bus listener: a cancel of a task leased to a remote worker is told to that worker."""
        if event.name != "task.cancel_requested" or event.data.get("attempt_id") is not None:
            return  # a revoke's cancels name their attempt and have been told already
        task_id = event.data["task_id"]
        found = self._gateway.book.of_task(task_id)
        if found is not None:
            attempt_id, booked = found
            self._gateway.controls.cancel(booked.identity, attempt_id)
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
