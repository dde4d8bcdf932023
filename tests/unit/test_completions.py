"""Completed tasks are logged one line each up to a budget a second; the rest are counted in one line."""

from __future__ import annotations

import logging

import pytest

from tidepool.logs import Completions


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_completion_has_its_line_until_the_budget_then_one_line_counts_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    completions = Completions(logging.getLogger("tidepool.engine"), lines_per_s=3, monotonic=clock)
    with caplog.at_level(logging.INFO, logger="tidepool.engine"):
        for i in range(10):
            completions.completed(f"t{i}", f"a{i}")
        completions.flush()  # within the second: nothing to say yet
        clock.now += 1.0
        completions.flush()
        completions.completed("t10", "a10")  # a new second: a line of its own again
    assert [r.getMessage() for r in caplog.records] == [
        "task t0 attempt a0 -> completed", "task t1 attempt a1 -> completed", "task t2 attempt a2 -> completed",
        "7 more tasks completed in the last 1.0s (past 3 a second, completions are counted, not logged one by one)",
        "task t10 attempt a10 -> completed"]
    assert {r.levelno for r in caplog.records} == {logging.INFO}


def test_the_drain_says_the_count_at_once_and_a_quiet_second_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    completions = Completions(logging.getLogger("tidepool.engine"), lines_per_s=1, monotonic=clock)
    with caplog.at_level(logging.INFO, logger="tidepool.engine"):
        clock.now += 5.0
        completions.flush()  # nothing completed: no line
        completions.completed("t0", "a0")
        completions.completed("t1", "a1")
        clock.now += 0.25
        completions.flush(final=True)
    assert [r.getMessage() for r in caplog.records] == [
        "task t0 attempt a0 -> completed",
        "1 more tasks completed in the last 0.2s (past 1 a second, completions are counted, not logged one by one)"]
