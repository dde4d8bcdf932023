"""Notices: what a store shared by several gateways tells each of them that another process changed: a remote worker's
attempt cancelled, a worker's registry record changed. The gateway whose control stream the worker is on acts
at once (a cancel frame, its new state, its parked acquires look again) rather than at its next renewal.

Hints, as the store's wake-ups are: a notice missed (its listening connection was down) costs latency, never
correctness. Renewals carry cancels, acquires read the record in their own transaction, and the gateways
read a record again at least once a second. Only a store that several processes share sends them
(PostgreSQL); one process hears its own changes in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable


class NoticeKind(Enum):
    CANCEL = "cancel"  # a remote attempt is cancelling: its worker stops it
    WORKER = "worker"  # a worker's record changed (its state, cap, types or organizations)


@dataclass(frozen=True, slots=True)
class Notice:
    kind: NoticeKind
    worker_id: str
    attempt_id: str | None = None  # of a cancel
    state: str | None = None       # of a worker's change: its state after it


@runtime_checkable
class NoticeSource(Protocol):
    """A store that tells its gateways of other processes' changes."""

    def hear_notices(self, heard: Callable[[Notice], None]) -> None:
        """From now on, `heard` gets each notice another process of the store sends (called in the event loop,
        never blocking)."""
