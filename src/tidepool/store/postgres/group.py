"""Group commit: calls that queue up while one statement is in flight go out together in the next."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from ...errors import StoreUnavailable
from .connection import said

I = TypeVar("I")  # noqa: E741  # an item queued for a grouped write
R = TypeVar("R")
MAX_GROUP = 256  # calls per grouped statement


class Group(Generic[I, R]):
    """Many callers' writes of one kind, sent as one statement per batch.

    A short-lived flusher task, owned here and awaited by drain(), sends the statements, so a caller
    cancelled mid-write cannot abort the write of the others (asyncio's own cancellation passes
    through anyio's shield). Each caller gets its own result; a failed statement gives each its own
    StoreUnavailable.
    """

    def __init__(self, run: Callable[[list[I]], Awaitable[list[R]]]) -> None:
        self._run = run
        self._queue: deque[tuple[I, asyncio.Future[R]]] = deque()
        self._flusher: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        return self._flusher is not None

    async def __call__(self, item: I) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._queue.append((item, future))
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush(), name="tidepool-postgres-group")
        return await future

    async def drain(self) -> None:
        """Wait until the calls already queued have been written."""
        if self._flusher is not None:
            await asyncio.wait([self._flusher])

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch: list[tuple[I, asyncio.Future[R]]] = []
                while self._queue and len(batch) < MAX_GROUP:
                    item, future = self._queue.popleft()
                    if not future.done():  # a caller cancelled while it waited is not written
                        batch.append((item, future))
                if batch:
                    await self._send(batch)
        finally:
            self._flusher = None
            while self._queue:  # left only when the flusher itself was cancelled (loop shutdown)
                _, future = self._queue.popleft()
                if not future.done():
                    future.set_exception(StoreUnavailable("the store shut down before this write was sent"))

    async def _send(self, batch: list[tuple[I, asyncio.Future[R]]]) -> None:
        try:
            results = await self._run([item for item, _ in batch])
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    error = StoreUnavailable(f"grouped write failed: {said(exc)}")
                    error.__cause__ = exc.__cause__ if isinstance(exc, StoreUnavailable) else exc
                    future.set_exception(error)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)
