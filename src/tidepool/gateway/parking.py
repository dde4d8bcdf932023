"""Parked acquires: remote workers' long polls waiting for a task they may take, woken as the pool's workers are.

A wake for n tasks wakes the n acquires parked longest. One that then leases nothing (the task was not of a
type, organization or tag it may take, or someone was quicker) hands the wake on to the next parked acquire
of another identity that has not tried since: a task only one worker of many may take still reaches it at
once, and one wake costs at most one claim per identity, never one per parked acquire. So does one that leaves
without claiming for its wake (its client went away, a repeat of its request_id superseded it, its hold
ended). An acquire in the middle of a claim is told to claim again, but the wake goes on to another as well:
that claim may have begun before the task existed, and if it leases something else the wake would be lost.
"""

from __future__ import annotations

import asyncio
from typing import Any

# Acquires one worker may have held at once; past it, an acquire claims once and is answered at once. A
# remote worker holds one at a time: the cap only keeps one identity from parking any number of them.
MAX_HELD_PER_WORKER = 64


class Parked:
    """One acquire on hold."""

    __slots__ = ("_event", "claiming", "claiming_for", "identity", "woken_by")

    def __init__(self, identity: str) -> None:
        self.identity = identity
        self._event = asyncio.Event()
        self.woken_by = 0      # the wake generation that woke it (0: none, or its own worker's change)
        self.claiming_for = 0  # the wake its current claim answers, until the claim has
        self.claiming = False  # armed, its claim not answered yet

    def set(self, generation: int) -> None:
        if not self._event.is_set():
            self.woken_by = generation
            self._event.set()

    @property
    def woken(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


class Parking:
    def __init__(self) -> None:
        self._parked: dict[Parked, None] = {}  # an ordered set: longest parked first
        self._generation = 0
        self._tried: dict[str, int] = {}  # identity -> the generation of its last claim that leased nothing
        self._held: dict[str, int] = {}  # identity -> its acquires parked
        self.changes = 0  # every wake and every worker's own: a claim begun at the same count finds the same

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, identity: str) -> Parked:
        parked = Parked(identity)
        self._parked[parked] = None
        self._held[identity] = self._held.get(identity, 0) + 1
        return parked

    def may_hold(self, identity: str) -> bool:
        """Whether one more acquire of this worker may be held."""
        return self._held.get(identity, 0) < MAX_HELD_PER_WORKER

    def arm(self, parked: Parked) -> None:
        """Before each claim: a wake from here on sets it again (one during the claim is not lost)."""
        parked.claiming_for, parked.woken_by = parked.woken_by, 0
        parked.claiming = True
        parked._event.clear()

    def leased(self, parked: Parked) -> None:
        """Its claim leased something: the wake it claimed for is used."""
        parked.claiming, parked.claiming_for = False, 0

    def leave(self, parked: Parked) -> None:
        """An acquire ends: a wake it did not claim for goes on to another identity."""
        if parked in self._parked:
            del self._parked[parked]
            self._held[parked.identity] -= 1
            if not self._held[parked.identity]:
                del self._held[parked.identity]
        unused = max(parked.woken_by, parked.claiming_for)  # woken since its last claim, or armed, not claimed
        parked.woken_by = parked.claiming_for = 0
        if unused:
            self._hand_on(parked.identity, unused)
        if parked.identity not in self._held:  # its last held acquire left
            self._tried.pop(parked.identity, None)

    def wake(self, n: int = 1) -> int:
        """Wake up to n parked acquires not woken yet; how many."""
        self._generation += 1
        self.changes += 1
        woken = 0
        for parked in self._parked:
            if woken >= n:
                break
            if parked.woken:
                continue
            if parked.claiming:  # claims again after, but the wake is not counted as delivered
                parked.set(0)
            else:
                parked.set(self._generation)
                woken += 1
        return woken

    def wake_identity(self, identity: str) -> None:
        """Every parked acquire of one worker: its record changed, or a live attempt of its ended."""
        self.changes += 1
        for parked in self._parked:
            if parked.identity == identity:
                parked.set(0)

    def came_back_empty(self, parked: Parked) -> None:
        """A woken acquire leased nothing: its wake goes on to the next identity that has not tried since."""
        generation, parked.claiming, parked.claiming_for = parked.claiming_for, False, 0
        if not generation:
            return  # its first claim, or woken by its own worker's change: no one else's wake to pass on
        self._tried[parked.identity] = generation
        self._hand_on(parked.identity, generation)

    def _hand_on(self, identity: str, generation: int) -> None:
        for other in self._parked:
            if not other.woken and other.identity != identity and \
                    self._tried.get(other.identity, 0) < generation:
                other.set(generation)
                return

    def identities(self) -> set[str]:
        return set(self._held)


# The acquires that need not ask the store: one whose caller was answered empty for the same ask, when nothing
# has woken the gateway's parked acquires since, parks at once.
#
# Whatever makes a task claimable here wakes the parked acquires (a submit, a promoted retry, an interrupted
# attempt, another node's submit heard from the store), and whatever changes what one worker may take wakes its
# own (a change of its record, an ending of one of its attempts): Parking counts both. While that count has
# not moved, a claim with the same filter, slots and version would find what the last one found: nothing. A task
# can also come free without a wake (a lease that ran out); so an identity's empty answer is trusted for one
# hold at most, the longest a parked acquire already waits without looking again.

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
