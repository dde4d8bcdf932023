"""Inputs placed in a work directory by a real (in-memory) store, and the hooks' placeholders."""

from __future__ import annotations

import stat
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import anyio
import pytest

from tidepool.errors import PluginError
from tidepool.execution.inputs import place_inputs
from tidepool.execution.leases import Held
from tidepool.execution.resources import ResourcePool, Slot
from tidepool.model import Claimed, ClaimFilter, NewTask, Worker
from tidepool.settings import ResourceSettings
from tidepool.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(10)


async def claimed_with(store: MemoryStore, files: dict[str, bytes]) -> Claimed:
    inputs = {}
    for name, data in files.items():
        async def chunks(data: bytes = data) -> AsyncIterator[bytes]:
            yield data

        blob, _ = await store.put_blob(chunks(), now=time.time(), max_bytes=1 << 20)
        inputs[name] = blob.sha256
    await store.add(NewTask("noop", {}, inputs=inputs), now=time.time())
    (claimed,) = await store.claim(Worker("n", "i", "w"), ClaimFilter(), limit=1, now=time.time(), lease_s=30.0)
    return claimed


def held(claimed: Claimed) -> Held:
    return Held(claimed.lease, anyio.CancelScope(), deadline=anyio.current_time() + 30)


async def test_each_input_is_a_read_only_file_of_the_work_directory(tmp_path: Path) -> None:
    store = MemoryStore()
    await store.open()
    claimed = await claimed_with(store, {"sample": b"\x00MZ", "hosts.txt": b"a\nb\n"})
    paths = await place_inputs(store, held(claimed), claimed.task, str(tmp_path / "w"))
    assert paths == {"sample": tmp_path / "w/inputs/sample", "hosts.txt": tmp_path / "w/inputs/hosts.txt"}
    assert paths["sample"].read_bytes() == b"\x00MZ" and paths["hosts.txt"].read_bytes() == b"a\nb\n"
    assert {stat.S_IMODE(p.stat().st_mode) for p in paths.values()} == {0o444}


async def test_a_blob_the_store_will_not_give_fails_inputs_unavailable_not_retried(tmp_path: Path) -> None:
    store = MemoryStore()
    await store.open()
    claimed = await claimed_with(store, {"sample": b"x"})
    claimed.task.inputs["other"] = "0" * 64  # no such blob: the store has none to give
    with pytest.raises(PluginError) as caught:
        await place_inputs(store, held(claimed), claimed.task, str(tmp_path / "w"))
    assert (caught.value.code, caught.value.retryable) == ("inputs_unavailable", False)
    assert "input other" in str(caught.value) and "0" * 64 in str(caught.value)


class Both:
    calls: list[tuple[str, object]] = []

    async def start(self, slot: Slot, values: Mapping[str, object]) -> None:
        Both.calls.append(("start", values["input:sample"]))

    async def stop(self, slot: Slot, values: Mapping[str, object]) -> None:
        Both.calls.append(("stop", values["input:sample"]))


async def test_hooks_that_take_values_get_the_same_at_start_and_stop() -> None:
    Both.calls.clear()
    pool = ResourcePool({"vm": ResourceSettings(tags=("win",))}, machinery={"vm": Both()})
    slot = await pool.acquire({"win"}, timeout_s=1.0, values={"input:sample": "/w/inputs/sample"})
    await pool.stop(slot)
    pool.release(slot)
    assert Both.calls == [("start", "/w/inputs/sample"), ("stop", "/w/inputs/sample")]
