"""What the gateway remembers of the attempts it handed out, and the lease token a remote worker holds.

The token a worker gets is its task's id and the store's lease token, joined by a dot: every write the worker
sends names its task that way, so any gateway of the store (after a restart too) can fence it without a
look-up. Forging the task id gains nothing: the store fences on all three of task, attempt and token.
The book keeps each attempt's task, type, owner and last phase for the events the gateway publishes; an attempt
another gateway (or an earlier process) handed out is booked at its first note, its type read from the store.
An entry's owner is always one the gateway established (it handed the attempt out, or the store named the owner
before the write that booked it), so the writes of that owner are taken as its own without a read.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..model import Lease

MAX_BOOKED = 200_000  # far beyond the attempts a fleet runs at once: the oldest are forgotten past it


def worker_token(task_id: str, token: str) -> str:
    return f"{task_id}.{token}"


def lease_of(attempt_id: str, lease_token: str) -> Lease:
    """The store's lease a worker's token names (the request model has checked its form)."""
    task_id, _, token = lease_token.partition(".")
    return Lease(task_id, attempt_id, token, 0.0)


@dataclass(slots=True)
class Booked:
    task_id: str
    type: str | None  # None: not read yet (an attempt this gateway did not hand out)
    identity: str
    phase: str | None = None  # the last one published
    lost: bool = False        # its loss was published


class Book:
    def __init__(self) -> None:
        self._attempts: OrderedDict[str, Booked] = OrderedDict()
        self._by_task: dict[str, str] = {}

    def add(self, attempt_id: str, booked: Booked) -> None:
        self._attempts[attempt_id] = booked
        self._by_task[booked.task_id] = attempt_id
        self._trim()

    def _trim(self) -> None:
        while len(self._attempts) > MAX_BOOKED:
            self.drop(next(iter(self._attempts)))

    def get(self, attempt_id: str) -> Booked | None:
        return self._attempts.get(attempt_id)

    def known(self, attempt_id: str, task_id: str, identity: str) -> Booked:
        """The attempt's entry, booked now if this gateway did not hand it out."""
        booked = self._attempts.get(attempt_id)
        if booked is None:  # a late note of a stale attempt must not take its task from the live one
            booked = self._attempts[attempt_id] = Booked(task_id, None, identity)
            self._by_task.setdefault(task_id, attempt_id)
            self._trim()
        return booked

    def first_loss(self, attempt_id: str, task_id: str, identity: str) -> bool:
        """Whether the attempt's lease is said lost for the first time; from now on its task is not its own (a
        cancel of the task goes to the attempt that holds it now)."""
        booked = self.known(attempt_id, task_id, identity)
        if self._by_task.get(task_id) == attempt_id:
            del self._by_task[task_id]
        if booked.lost:
            return False
        booked.lost = True
        return True

    def of_task(self, task_id: str) -> tuple[str, Booked] | None:
        attempt_id = self._by_task.get(task_id)
        booked = None if attempt_id is None else self._attempts.get(attempt_id)
        return None if attempt_id is None or booked is None else (attempt_id, booked)

    def drop(self, attempt_id: str) -> None:
        booked = self._attempts.pop(attempt_id, None)
        if booked is not None and self._by_task.get(booked.task_id) == attempt_id:
            del self._by_task[booked.task_id]
