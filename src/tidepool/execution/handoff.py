"""The handoff: the tasks a claim brought for idle workers, each held under its lease until a worker takes it.

One claim serves every worker free to start a task now: the claiming worker starts the first task and
leaves the rest here for the idle workers it wakes, so a burst of work costs one claim transaction, not
one per worker. A task waits here renewed like any other, and stoppable: a cancel ends it at once,
without a phase (nothing ran); an interrupt or a fence gives it back. One that no idle worker is left to
take (they retired or left since the claim counted them in) is given back at once, its attempt not
charged, rather than wait for a busy worker to finish; so is every one when the pool stops claiming,
for another node to run it meanwhile rather than after the drain.

Each task counts an idle worker in until a worker takes it or passes it, those that ended while they
waited too: the claim that brought them woke a worker for each, and the pool's next claims count those
workers out as long as their tasks are here.
"""

from __future__ import annotations

from ..model import CANCELLED_ON_REQUEST, AttemptStatus, Claimed, Outcome, TaskError
from .leases import Held, LeaseKeeper
from .outcomes import Outcomes

_Waiting = tuple[Claimed, Held, str]  # the claimer's worker id, for the events of a task that never starts
RELEASED_UNSTARTED = TaskError("interrupted", "released unstarted")


class Handoff:
    def __init__(self, leases: LeaseKeeper, outcomes: Outcomes) -> None:
        self._leases = leases
        self._outcomes = outcomes
        # By attempt id, oldest first; None once it ended while it waited, until a worker passes it.
        self._waiting: dict[str, _Waiting | None] = {}

    def __len__(self) -> int:
        """The idle workers the tasks here count in: one each, whether it waits still or ended meanwhile."""
        return len(self._waiting)

    def put(self, claimed: Claimed, worker_id: str) -> None:
        """A task a claim leased for another idle worker: held (renewed, stoppable) until a worker takes it."""
        held = self._leases.hold(claimed.lease)
        held.waiting = self._stopped
        self._waiting[claimed.lease.attempt_id] = (claimed, held, worker_id)

    def take(self) -> tuple[Claimed, Held] | None:
        """The oldest task waiting, to run now; those that ended meanwhile are passed (and no longer count)."""
        while self._waiting:
            waiting = self._waiting.pop(next(iter(self._waiting)))
            if waiting is not None:
                waiting[1].waiting = None  # its turn: from here a stop cancels its scope
                return waiting[0], waiting[1]
        return None

    def give_back_beyond(self, takers: int) -> None:
        """Keep as many tasks as there are idle workers to take them, the oldest; give the rest back."""
        while len(self._waiting) > takers:
            _, waiting = self._waiting.popitem()
            if waiting is not None:
                self._give_back(*waiting)

    def give_back_all(self) -> None:
        """Every task here goes back at once, and the stopped ones' places are forgotten (the pool stops
        claiming)."""
        waiting = [w for w in self._waiting.values() if w is not None]
        self._waiting.clear()
        for claimed, held, worker_id in waiting:
            self._give_back(claimed, held, worker_id)

    def _stopped(self, held: Held) -> None:
        """A task stopped before a worker took it: it ends now, without a phase (nothing ran)."""
        attempt_id = held.lease.attempt_id
        waiting = self._waiting.get(attempt_id)
        if waiting is None:
            return
        self._waiting[attempt_id] = None  # its place counts until a worker passes it
        claimed, _, worker_id = waiting
        if held.why == "cancel":
            self._outcomes.conclude(claimed.task, held, Outcome(AttemptStatus.CANCELLED, CANCELLED_ON_REQUEST),
                                    worker_id)
        elif held.why in ("interrupt", "fenced"):
            self._give_back(claimed, held, worker_id)
        else:  # its lease is gone: nothing of it may be written
            self._outcomes.conclude(claimed.task, held, None, worker_id)

    def _give_back(self, claimed: Claimed, held: Held, worker_id: str) -> None:
        held.waiting = None  # ended: a later stop (its lease lost before the outcome is written) is no news here
        self._outcomes.conclude(claimed.task, held, Outcome(AttemptStatus.INTERRUPTED, RELEASED_UNSTARTED), worker_id)
