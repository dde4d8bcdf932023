"""Replays of acquires by request_id: a worker that sends an acquire again (its answer was lost in transit)
gets the very leases the first one made, for as long as a lease lasts, rather than strand them until they
expire. Kept by this gateway in memory: a repeat sent to another gateway leases anew."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

OnGone = Callable[[Callable[[], None]], Callable[[], None]]  # registers what ends a hold; returns its undo

MAX_KEPT = 100_000


class Replay:
    """One request_id: its answer once made; `superseded` when a repeat came while it was still held."""

    def __init__(self) -> None:
        self.answer: Any = None
        self.done = asyncio.Event()
        self.superseded = asyncio.Event()
        self.kept_until = float("inf")
        self._end_hold: Callable[[], None] | None = None

    def also(self, on_gone: OnGone) -> OnGone:
        """`on_gone`, and a repeat of the request_id ends the hold as well."""
        def register(end_hold: Callable[[], None]) -> Callable[[], None]:
            undo = on_gone(end_hold)
            self._end_hold = end_hold

            def undo_both() -> None:
                self._end_hold = None
                undo()
            return undo_both
        return register

    def supersede(self) -> None:
        self.superseded.set()
        if self._end_hold is not None:
            self._end_hold()


class Replays:
    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[str, str], Replay] = OrderedDict()

    def find(self, identity: str, request_id: str, *, now: float) -> Replay | None:
        self._prune(now)
        return self._kept.get((identity, request_id))

    def start(self, identity: str, request_id: str) -> Replay:
        replay = self._kept[(identity, request_id)] = Replay()
        self._kept.move_to_end((identity, request_id))
        while len(self._kept) > MAX_KEPT:
            self._kept.popitem(last=False)
        return replay

    def answered(self, replay: Replay, answer: Any, *, keep_until: float) -> None:
        replay.answer = answer
        replay.kept_until = keep_until
        replay.done.set()

    def forget(self, identity: str, request_id: str, replay: Replay) -> None:
        """An acquire that failed (its error was the answer): a repeat tries afresh."""
        if self._kept.get((identity, request_id)) is replay:
            del self._kept[(identity, request_id)]
        replay.done.set()

    def _prune(self, now: float) -> None:
        while self._kept:
            replay = next(iter(self._kept.values()))
            if replay.kept_until > now:
                return
            self._kept.popitem(last=False)
