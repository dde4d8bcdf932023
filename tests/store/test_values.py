"""Bytes a scan target controls never cost an outcome: a NUL, a byte that is not UTF-8 (a lone surrogate in
Python) or an escaped lone surrogate in anything a worker writes is stored as U+FFFD on every store, and the
write lands as if it were not there; a value a store still refuses is ValueRefused, never an outage."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tidepool.errors import StoreUnavailable, ValueRefused
from tidepool.model import AttemptStatus, Outcome, Phase, ResultBatch, State, TaskError, sha256_of
from tidepool.store import Ending, PhaseNote, Store
from tidepool.store.sqlite import SqliteStore

from .conftest import POLICY, T0
from .test_contract import running

NUL, BAD_BYTE, LONE = "\x00", "\udcff", "\ud800"  # BAD_BYTE: b"\xff" read with surrogateescape
R = "\ufffd"


def dirty(s: str) -> str:
    return f"a{NUL}b{BAD_BYTE}c{LONE}d{s}"


CLEAN = f"a{R}b{R}c{R}d"


async def test_a_failed_endings_text_is_stored_with_each_unstorable_character_replaced(store: Store) -> None:
    c = await running(store)
    ended = Outcome(AttemptStatus.FAILED, TaskError("exit_status", dirty(" exited 3"), False), 3, dirty("\n"),
                    progress={"fraction": 0.5, "message": dirty("")})
    assert await store.finish(c.lease, ended, now=T0 + 1, policy=POLICY) is State.FAILED
    t = await store.get(c.task.id)
    assert t.error is not None and (t.error.code, t.error.message) == ("exit_status", CLEAN + " exited 3")
    a = t.attempts[0]
    assert (a.status, a.exit_status, a.stderr_tail, a.error) == (AttemptStatus.FAILED, 3, CLEAN + "\n", t.error)
    assert t.progress == {"fraction": 0.5, "message": CLEAN}


async def test_a_succeeded_ending_with_unstorable_text_completes_the_task(store: Store) -> None:
    c = await running(store)
    ended = Outcome(AttemptStatus.SUCCEEDED, stderr_tail=dirty(""), progress={"fraction": 1.0, "message": NUL})
    assert await store.finish(c.lease, ended, now=T0 + 1, policy=POLICY) is State.COMPLETED
    t = await store.get(c.task.id)
    assert (t.state, t.attempts[0].stderr_tail, t.progress) == (State.COMPLETED, CLEAN, {"fraction": 1.0,
                                                                                        "message": R})


async def test_bare_successes_share_a_write_with_unstorable_progress(store: Store) -> None:
    first, second = await running(store, type="a"), await running(store, type="b")
    endings = [Outcome(AttemptStatus.SUCCEEDED, progress={"fraction": 1.0, "message": dirty("")}),
               Outcome(AttemptStatus.SUCCEEDED)]
    answers = await store.finish_many([Ending(c.lease, o, T0 + 1) for c, o in zip((first, second), endings,
                                                                                   strict=True)], policy=POLICY)
    assert answers == [State.COMPLETED, State.COMPLETED]
    assert (await store.get(first.task.id)).progress == {"fraction": 1.0, "message": CLEAN}


async def test_a_result_payloads_strings_keys_and_nested_values_are_stored_storable(store: Store) -> None:
    c = await running(store)
    payload: Any = {"text": dirty(""), dirty("k"): [dirty(""), {"deep": NUL, NUL: 1}], "n": 7, "ok": True}
    batch = ResultBatch("command", 0, f"{c.task.id}:k1", sha256_of(payload), True, payload, c.lease.attempt_id)
    ack = await store.record_result(c.lease, batch, now=T0 + 1)
    stored = {"text": CLEAN, CLEAN + "k": [CLEAN, {"deep": R, R: 1}], "n": 7, "ok": True}
    assert (ack.payload, ack.sha256, ack.stored_now) == (stored, sha256_of(stored), True)
    again = await store.record_result(c.lease, batch, now=T0 + 2)  # sent again: the same batch, not a conflict
    assert (again.payload, again.sha256) == (stored, sha256_of(stored))
    assert await store.finish(c.lease, Outcome(AttemptStatus.SUCCEEDED), now=T0 + 3, policy=POLICY) is State.COMPLETED
    t = await store.get(c.task.id)
    assert [r.payload for r in t.results] == [stored]


async def test_a_results_plugin_name_and_key_are_stored_storable_and_the_task_completes(store: Store) -> None:
    c = await running(store)
    payload = {"n": 1}
    batch = ResultBatch(dirty("plugin"), 0, f"{c.task.id}:{dirty('k')}", sha256_of(payload), True, payload,
                        c.lease.attempt_id)
    ack = await store.record_result(c.lease, batch, now=T0 + 1)
    assert (ack.plugin, ack.idempotency_key, ack.stored_now) == (CLEAN + "plugin", f"{c.task.id}:{CLEAN}k", True)
    again = await store.record_result(c.lease, batch, now=T0 + 2)  # the same key cleaned alike: found, not new
    assert (again.idempotency_key, again.stored_now) == (ack.idempotency_key, False)
    assert await store.finish(c.lease, Outcome(AttemptStatus.SUCCEEDED), now=T0 + 3, policy=POLICY) is State.COMPLETED
    t = await store.get(c.task.id)
    assert [(r.plugin, r.idempotency_key) for r in t.results] == [(CLEAN + "plugin", f"{c.task.id}:{CLEAN}k")]


async def test_a_phase_notes_progress_message_is_stored_storable(store: Store) -> None:
    c = await running(store)
    note = PhaseNote(c.lease, Phase.RUN, {"fraction": 0.25, "message": dirty("")})
    assert await store.set_phase([note], now=T0 + 1) == {}
    assert (await store.get(c.task.id)).progress == {"fraction": 0.25, "message": CLEAN}


async def test_a_scan_steps_learned_scope_is_not_refused(store: Store) -> None:
    """What a step's plugins learn comes from the target as well; a task outside a scan ignores it."""
    c = await running(store)
    ended = Outcome(AttemptStatus.SUCCEEDED, scope={dirty("k"): dirty("")})
    assert await store.finish(c.lease, ended, now=T0 + 1, policy=POLICY) is State.COMPLETED


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_value_the_store_cannot_keep_is_value_refused_and_not_an_outage(store: Store) -> None:
    """Past what any scrubbing can make storable (an exit status past 64 bits): the store's refusal is its own
    error, which no caller retries as though the store were away, and the store still takes writes."""
    c = await running(store)
    ended = Outcome(AttemptStatus.FAILED, TaskError("exit_status", "exited", False), 2**70)
    with pytest.raises(ValueRefused) as refused:
        await store.finish(c.lease, ended, now=T0 + 1, policy=POLICY)
    assert not isinstance(refused.value, StoreUnavailable)
    assert await store.write_failure() is None
    fine = Outcome(AttemptStatus.FAILED, TaskError("exit_status", "exited", False), 2)
    assert await store.finish(c.lease, fine, now=T0 + 2, policy=POLICY) is State.FAILED


@pytest.mark.parametrize("kind", ["sqlite"])
async def test_sqlite_keeps_no_nul_in_its_file(store: Store, tmp_path: Path) -> None:
    """SQLite would have taken a NUL: stored the same as elsewhere, the file holds U+FFFD."""
    c = await running(store)
    await store.finish(c.lease, Outcome(AttemptStatus.SUCCEEDED, stderr_tail=NUL), now=T0 + 1, policy=POLICY)
    assert isinstance(store, SqliteStore)
    with sqlite3.connect(tmp_path / "tidepool.db") as conn:
        assert conn.execute("SELECT stderr_tail FROM attempts").fetchall() == [(R,)]
