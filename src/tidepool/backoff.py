"""How long to wait before trying again something that failed for want of an answer: one backoff policy.

Pure: it only says the waits. The loop that tries again stays the caller's, and a caller that retries
calls only what does not retry itself, so no retry is wrapped in another (their waits would multiply).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Waits of `first_s`, each `factor` times the last, at most `cap_s`; `tries` of them, or without end
    (None). With `jitter` (0 to 1), each wait is drawn from [(1 - jitter) * wait, wait]: processes that
    failed together do not all try again at the same moment."""

    first_s: float
    cap_s: float
    tries: int | None = None
    factor: float = 2.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.cap_s or self.factor < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff: need 0 < first_s <= cap_s, factor >= 1, jitter in [0, 1]: {self}")

    def delay(self, retry: int) -> float | None:
        """The wait before try-again number `retry` (0: the first), or None once the tries are used up."""
        if retry < 0 or (self.tries is not None and retry >= self.tries):
            return None
        wait = min(self.first_s * self.factor ** min(retry, 64), self.cap_s)  # 64: the cap is long reached
        return wait * (1 - self.jitter * random.random()) if self.jitter else wait

    def delays(self) -> Iterator[float]:
        """The waits before each try again, in order; a new iterator starts again from `first_s`."""
        retry = 0
        while (wait := self.delay(retry)) is not None:
            yield wait
            retry += 1
