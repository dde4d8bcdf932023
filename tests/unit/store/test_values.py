"""Storable values: each NUL and lone surrogate becomes U+FFFD, in every string of a JSON value, keys too; a
clean value comes back as the very same object (the hot path copies nothing)."""

from __future__ import annotations

from typing import Any

import pytest

from tidepool.model import AttemptStatus, Outcome, ResultBatch, TaskError, sha256_of
from tidepool.store import values

R = "\ufffd"


@pytest.mark.parametrize("raw, stored", [
    ("plain", "plain"), ("é ü 中 😀", "é ü 中 😀"), ("a\x00b", f"a{R}b"), ("\udcff\udcfe", f"{R}{R}"),
    ("\ud800x\udfff", f"{R}x{R}"), ("\ufffd", "\ufffd"), ("tab\tand\nnewline", "tab\tand\nnewline"),
    ("\\u0000 as text", "\\u0000 as text"),
])
def test_text(raw: str, stored: str) -> None:
    assert values.text(raw) == stored


@pytest.mark.parametrize("raw, stored", [
    ({"a": "x\x00"}, {"a": f"x{R}"}),
    ({"k\x00": 1}, {f"k{R}": 1}),
    ([1, "a\udcff", [{"b": ["\x00"]}]], [1, f"a{R}", [{"b": [R]}]]),
    ({"n": 1.5, "t": True, "z": None}, {"n": 1.5, "t": True, "z": None}),
])
def test_json_value_and_payload(raw: Any, stored: Any) -> None:
    assert values.json_value(raw) == stored
    assert values.payload(raw) == stored


@pytest.mark.parametrize("clean", [{"a": [1, {"b": "c"}]}, ["x", "y"], "s", 3, {"é": "中"}, {"text": "\\u0000"}])
def test_a_clean_value_is_the_same_object(clean: Any) -> None:
    assert values.json_value(clean) is clean
    assert values.payload(clean) is clean


def test_an_outcome_keeps_its_status_and_exit_status_and_a_clean_one_is_itself() -> None:
    clean = Outcome(AttemptStatus.FAILED, TaskError("exit_status", "exited 3"), 3, "tail", {"fraction": 1.0})
    assert values.outcome(clean) is clean
    dirty = Outcome(AttemptStatus.FAILED, TaskError("exit_status", "exited \x00", False), 3, "t\udcff",
                    {"message": "\x00"}, {"k": "\x00"})
    assert values.outcome(dirty) == Outcome(AttemptStatus.FAILED, TaskError("exit_status", f"exited {R}", False), 3,
                                            f"t{R}", {"message": R}, {"k": R})


def test_a_batch_made_storable_carries_its_stored_payloads_digest() -> None:
    payload = {"a": "\x00"}
    batch = ResultBatch("p", 0, "k", sha256_of(payload), True, payload)
    stored = values.batch(batch)
    assert (stored.payload, stored.sha256) == ({"a": R}, sha256_of({"a": R}))
    clean = ResultBatch("p", 0, "k", sha256_of({"a": 1}), True, {"a": 1})
    assert values.batch(clean) is clean
