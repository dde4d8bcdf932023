"""The one backoff policy: its waits, their cap, their end, and the jitter that spreads them."""

from __future__ import annotations

import itertools

import pytest

from tidepool.backoff import Backoff


def test_waits_double_up_to_the_cap_and_end_after_the_tries() -> None:
    backoff = Backoff(first_s=0.25, cap_s=2.0, tries=5)
    assert list(backoff.delays()) == [0.25, 0.5, 1.0, 2.0, 2.0]
    assert backoff.delay(5) is None and backoff.delay(-1) is None


def test_without_a_limit_the_waits_go_on_at_the_cap() -> None:
    backoff = Backoff(first_s=0.1, cap_s=5.0)
    assert list(itertools.islice(backoff.delays(), 8)) == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
    assert backoff.delay(10_000) == 5.0


def test_a_fixed_wait_is_a_factor_of_one() -> None:
    assert list(Backoff(first_s=0.5, cap_s=0.5, tries=3, factor=1.0).delays()) == [0.5, 0.5, 0.5]


def test_jitter_takes_off_at_most_its_share() -> None:
    waits = [Backoff(first_s=1.0, cap_s=1.0, jitter=0.5).delay(0) for _ in range(200)]
    assert all(w is not None and 0.5 <= w <= 1.0 for w in waits)
    assert len(set(waits)) > 1


@pytest.mark.parametrize("args", [(0.0, 1.0), (2.0, 1.0), (0.1, 1.0, None, 0.5), (0.1, 1.0, None, 2.0, 1.5)])
def test_a_policy_that_cannot_wait_is_refused(args: tuple[float, ...]) -> None:
    with pytest.raises(ValueError):
        Backoff(*args)  # type: ignore[arg-type]
