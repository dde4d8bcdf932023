"""What the gateway remembers of the attempts it handed out, and the lease token a remote worker holds.

The token a worker gets is its task's id and the store's lease token, joined by a dot: every write the worker
sends names its task that way, so any gateway of the store (after a restart too) can fence it without a
look-up. Forging the task id gains nothing: the store fences on all three of task, attempt and token.
The book keeps each attempt's task, type, owner and last phase for the events the gateway publishes; what it
does not know (an attempt another gateway, or an earlier process, handed out) is read from the store.
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
    type: str
    identity: str
    phase: str | None = None


class Book:
    def __init__(self) -> None:
        self._attempts: OrderedDict[str, Booked] = OrderedDict()
        self._by_task: dict[str, str] = {}

    def add(self, attempt_id: str, booked: Booked) -> None:
        self._attempts[attempt_id] = booked
        self._by_task[booked.task_id] = attempt_id
        while len(self._attempts) > MAX_BOOKED:
            self.drop(next(iter(self._attempts)))

    def get(self, attempt_id: str) -> Booked | None:
        return self._attempts.get(attempt_id)

    def of_task(self, task_id: str) -> tuple[str, Booked] | None:
        attempt_id = self._by_task.get(task_id)
        booked = None if attempt_id is None else self._attempts.get(attempt_id)
        return None if attempt_id is None or booked is None else (attempt_id, booked)

    def drop(self, attempt_id: str) -> None:
        booked = self._attempts.pop(attempt_id, None)
        if booked is not None and self._by_task.get(booked.task_id) == attempt_id:
            del self._by_task[booked.task_id]
