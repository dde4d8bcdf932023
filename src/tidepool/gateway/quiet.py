"""The acquires that need not ask the store: one whose caller was answered empty for the same ask, when nothing
has woken the gateway's parked acquires since, parks at once.

Whatever makes a task claimable here wakes the parked acquires (a submit, a promoted retry, an interrupted
attempt, another node's submit heard from the store), and whatever changes what one worker may take wakes its
own (a change of its record, an ending of one of its attempts): Parking counts both. While that count has
not moved, a claim with the same filter, slots and version would find what the last one found: nothing. A task
can also come free without a wake (a lease that ran out); so an identity's empty answer is trusted for one
hold at most, the longest a parked acquire already waits without looking again.
"""

from __future__ import annotations

from typing import Any


class EmptyAnswers:
    """Per identity: what its last claim that leased nothing asked, the wake count it began at, and when."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[Any, int, float]] = {}

    def note(self, identity: str, ask: Any, *, changes: int, now: float) -> None:
        """A claim begun at wake count `changes` leased nothing for `ask`."""
        self._last[identity] = (ask, changes, now)

    def forget(self, identity: str) -> None:
        self._last.pop(identity, None)

    def still_empty(self, identity: str, ask: Any, *, changes: int, now: float, trust_s: float) -> bool:
        """Whether a claim for `ask` now would lease nothing, as far as the gateway can tell without the store."""
        last = self._last.get(identity)
        return last is not None and last[1] == changes and last[0] == ask and now - last[2] < trust_s
