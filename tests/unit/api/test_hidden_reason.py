"""What an open readiness probe tells a caller without the token: the node's own words, of a store's failure
only that it is one (a remote worker's standing at its gateway too, without the gateway's address)."""

from __future__ import annotations

import pytest

from tidepool.http.refusals import hidden_reason


@pytest.mark.parametrize("reason, shown", [
    ("draining", "draining"),
    ("starting", "starting"),
    ("store unavailable: store 10.0.0.5:5432/tidepool schema prod: ConnectionRefusedError: [Errno 111]",
     "store unavailable"),
    ("store unavailable: sqlite write to /var/lib/tidepool/tidepool.db failed: disk I/O error", "store unavailable"),
    ("store unavailable: no answer within 2s", "store unavailable"),
    ("store unavailable: the gateway https://gw.internal:8471 has this worker pending",
     "store unavailable: this worker is pending at its gateway"),
    ("store unavailable: the gateway https://gw.internal:8471 has this worker revoked",
     "store unavailable: this worker is revoked at its gateway"),
])
def test_an_open_probe_says_nothing_of_the_inside(reason: str, shown: str) -> None:
    assert hidden_reason(reason) == shown
