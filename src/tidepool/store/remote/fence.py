"""Which of a remote worker's leases are still live here: each one's end on this host's monotonic clock,
and the attempts the gateway asked to stop. A write for a lease past its end is not sent: the worker
writes nothing more for an attempt it could not renew in time (another worker may run it by now)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ...errors import LeaseLost, TaskCancelling
from ...model import Lease


class LocalLeases:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._until: dict[str, float] = {}  # attempt id -> monotonic end of its lease as known here
        self._cancelling: set[str] = set()  # the gateway asked to stop these: their cancel may still be written

    def granted(self, attempt_id: str, until: float) -> None:
        """Granted or renewed, to end at monotonic `until`."""
        self._until[attempt_id] = until

    def cancelling(self, attempt_id: str) -> None:
        """The gateway takes this attempt's cancel whatever its lease: its ending may go out after the end."""
        self._cancelling.add(attempt_id)

    def alive(self, attempt_id: str) -> bool:
        until = self._until.get(attempt_id)
        return attempt_id in self._cancelling or (until is not None and self._monotonic() < until)

    def time_left(self, attempt_id: str) -> float:
        """Seconds until the lease ends here; unbounded for a cancel's attempt, whose ending is taken anyway."""
        if attempt_id in self._cancelling:
            return float("inf")
        return self._until.get(attempt_id, 0.0) - self._monotonic()

    def split(self, leases: Sequence[Lease]) -> tuple[list[Lease], dict[str, LeaseLost]]:
        """The leases still live here, and the others as lost (nothing is to be sent for them)."""
        live = [x for x in leases if self.alive(x.attempt_id)]
        return live, {x.attempt_id: ended_here(x) for x in leases if not self.alive(x.attempt_id)}

    def lost(self, lease: Lease, reason: str | None) -> LeaseLost:
        """The gateway says the lease is gone, and why: a cancel's attempt may still say it stopped."""
        if reason == "cancelled":
            self.cancelling(lease.attempt_id)
            return TaskCancelling(lease.task_id, lease.attempt_id)
        self.forget(lease.attempt_id)
        return LeaseLost(lease.task_id, lease.attempt_id, f"the gateway says the lease is lost ({reason or 'lost'})")

    def forget(self, attempt_id: str) -> None:
        self._until.pop(attempt_id, None)
        self._cancelling.discard(attempt_id)


def ended_here(lease: Lease) -> LeaseLost:
    return LeaseLost(lease.task_id, lease.attempt_id, "lease ended here before a renewal got through; nothing "
                                                       "more is written for it")
