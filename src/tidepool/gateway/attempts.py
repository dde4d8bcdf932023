"""Remote attempts: what the gateway remembers of the attempts remote workers run, and the lease token a remote
worker holds for each.

The token a worker gets is its task's id and the store's lease token, joined by a dot: every write the worker
sends names its task that way, so any gateway of the store (after a restart too) can fence it without a
look-up. Forging the task id gains nothing: the store fences on all three of task, attempt and token.
Each attempt's task, type, owner and last phase are kept for the events the gateway publishes, and its task's
type and own timeout for its run deadline, which the gateway computes from its own settings, never from what the
worker says; an attempt another gateway (or an earlier process) handed out is known from its first note, its
type and timeout read from the store.
An attempt's owner is always one the gateway established (it handed the attempt out, or the store named the
owner before the write that made it known), so the writes of that owner are taken as its own without a read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..errors import TaskNotFound
from ..model import Lease, Task
from ..store.bounds import RunDeadline

MAX_KNOWN = 200_000  # far beyond the attempts a fleet runs at once: the oldest are forgotten past it


def worker_token(task_id: str, token: str) -> str:
    return f"{task_id}.{token}"


def lease_of(attempt_id: str, lease_token: str) -> Lease:
    """The store's lease a worker's token names (the request model has checked its form)."""
    task_id, _, token = lease_token.partition(".")
    return Lease(task_id, attempt_id, token, 0.0)


@dataclass(slots=True)
class RemoteAttempt:
    """One attempt a remote worker runs, as the gateway knows it."""

    task_id: str
    type: str | None  # None: not read yet (an attempt this gateway did not hand out)
    identity: str
    phase: str | None = None  # the last one published
    lost: bool = False        # its loss was published
    progress_at: float = float("-inf")  # when its progress was last published
    limits: tuple[str, float | None] | None = None  # its task's (type, own timeout_s), once known


class RemoteAttempts:
    """The remote attempts by attempt id, oldest first, and which one holds each task."""

    def __init__(self) -> None:
        self._attempts: OrderedDict[str, RemoteAttempt] = OrderedDict()
        self._by_task: dict[str, str] = {}

    def add(self, attempt_id: str, attempt: RemoteAttempt) -> None:
        self._attempts[attempt_id] = attempt
        self._by_task[attempt.task_id] = attempt_id
        self._trim()

    def _trim(self) -> None:
        while len(self._attempts) > MAX_KNOWN:
            self.drop(next(iter(self._attempts)))

    def get(self, attempt_id: str) -> RemoteAttempt | None:
        return self._attempts.get(attempt_id)

    def known(self, attempt_id: str, task_id: str, identity: str) -> RemoteAttempt:
        """The attempt, known from now on if this gateway did not hand it out."""
        attempt = self._attempts.get(attempt_id)
        if attempt is None:  # a late note of a stale attempt must not take its task from the live one
            attempt = self._attempts[attempt_id] = RemoteAttempt(task_id, None, identity)
            self._by_task.setdefault(task_id, attempt_id)
            self._trim()
        return attempt

    async def deadline_s(self, attempt_id: str, task_id: str, identity: str, *, rule: RunDeadline,
                         read: Callable[[str], Awaitable[Task]]) -> float | None:
        """How long from now the attempt may live, its run phase having started: from the task as the store
        holds it and the gateway's own settings. None when the token's task is gone from the store or is not
        the attempt's (the store refuses that note): such a note must not make the attempt known as another
        task's, nor lend it another task's timeout."""
        attempt = self._attempts.get(attempt_id)
        if attempt is not None and attempt.task_id != task_id:
            return None
        if attempt is None or attempt.limits is None:
            try:
                task = await read(task_id)
            except TaskNotFound:
                return None
            if not any(a.id == attempt_id for a in task.attempts):
                return None
            attempt = self.known(attempt_id, task_id, identity)
            attempt.limits, attempt.type = (task.type, task.timeout_s), attempt.type or task.type
        return rule.seconds(*attempt.limits)

    def first_loss(self, attempt_id: str, task_id: str, identity: str) -> bool:
        """Whether the attempt's lease is said lost for the first time; from now on its task is not its own (a
        cancel of the task goes to the attempt that holds it now)."""
        attempt = self.known(attempt_id, task_id, identity)
        if self._by_task.get(task_id) == attempt_id:
            del self._by_task[task_id]
        if attempt.lost:
            return False
        attempt.lost = True
        return True

    def of_task(self, task_id: str) -> tuple[str, RemoteAttempt] | None:
        attempt_id = self._by_task.get(task_id)
        attempt = None if attempt_id is None else self._attempts.get(attempt_id)
        return None if attempt_id is None or attempt is None else (attempt_id, attempt)

    def drop(self, attempt_id: str) -> None:
        attempt = self._attempts.pop(attempt_id, None)
        if attempt is not None and self._by_task.get(attempt.task_id) == attempt_id:
            del self._by_task[attempt.task_id]
