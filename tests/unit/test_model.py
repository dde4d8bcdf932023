"""Model helpers every JSON answer and event uses."""

from __future__ import annotations

import random
from datetime import UTC, datetime

from tidepool.model import rfc3339


def test_rfc3339_matches_datetime_to_the_microsecond() -> None:
    rng = random.Random(7)
    stamps = [0.0, 1.9999995, 1_700_000_000.9999996, -1.5] + [rng.uniform(-2e9, 4e9) for _ in range(20_000)]
    for ts in stamps:
        expected = datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
        assert rfc3339(ts) == expected, ts
