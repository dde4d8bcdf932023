"""What a gateway holds a remote worker's attempt to, whatever the worker says, over real TLS with a raw /w1
client: the run deadline (its renewals and writes refused past it, the reconciler ending it timed_out) and the
result quota (batches past it refused 413, the attempt still finishing)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from tidepool.model import rfc3339

from .conftest import AUTO, Node, Remote, lease_of, sha256

# A run timeout of 0.3 s (the task's own), a stop phase of 0.2 s, a lease of 1.2 s: a deadline 1.7 s after the
# run phase starts. The reconciler looks every 0.2 s.
FAST = {"lease": {"duration_s": 1.2, "renew_every_s": 0.3}, "execution": {"stop_timeout_s": 0.2},
        "reconciler": {"interval_s": 0.2}, "gateway": AUTO}


async def running(node: Node, remote: Remote, **fields: Any) -> tuple[str, dict[str, Any]]:
    task_id = await node.submit("noop", **fields)
    lease = await remote.leased()
    note = {**lease_of(lease), "phase": "run"}
    answer = await remote.post("/w1/phase", {"notes": [note]})
    assert answer == (200, {"lost": []}), answer
    return task_id, lease


async def state_of(node: Node, task_id: str, wanted: str, *, timeout_s: float = 10.0) -> dict[str, Any]:
    with anyio.fail_after(timeout_s):
        while (task := await node.task(task_id))["state"] != wanted:
            await anyio.sleep(0.05)
    return task


@pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])
async def test_a_worker_renewing_past_its_deadline_is_refused_and_its_task_times_out(
        make_node: Callable[..., Any]) -> None:
    async with make_node(**FAST) as node:
        remote = node.remote("w1")
        started = time.time()
        task_id, lease = await running(node, remote, timeout_s=0.3)
        task = await node.task(task_id)
        deadline_at = task["attempts"][0]["deadline_at"]
        assert deadline_at is not None
        assert rfc3339(started + 1.7) <= deadline_at <= rfc3339(time.time() + 1.7)
        with anyio.fail_after(10):
            while True:  # renewed as often as the gateway asks, well past the deadline
                answer = await remote.post("/w1/renew", {"leases": [lease_of(lease)]})
                assert answer.status == 200, answer
                (item,) = answer.body["leases"]
                if item["status"] != "held":
                    break
                await anyio.sleep(0.3)
        assert item == {"attempt_id": lease["attempt_id"], "status": "lost", "reason": "deadline"}
        assert time.time() >= started + 1.7
        payload = {"late": True}
        answer = await remote.post("/w1/results", {**lease_of(lease), "plugin": "noop", "sequence": 0,
                                                    "idempotency_key": "late", "sha256": sha256(payload),
                                                    "final": True, "payload": payload})
        assert answer.status == 410 and answer.code == "lease_lost" and answer.error["reason"] == "deadline"
        task = await state_of(node, task_id, "timed_out")
        assert task["error"]["code"] == "timeout"
        assert task["attempts"][0]["status"] == "timed_out"
        answer = await remote.post("/w1/finish", {"endings": [{**lease_of(lease), "status": "succeeded"}]})
        assert answer.body["endings"] == [{"attempt_id": lease["attempt_id"], "lost": "deadline"}]
        assert (await node.task(task_id))["state"] == "timed_out"


async def test_a_worker_cannot_move_its_deadline_by_what_it_sends(make_node: Callable[..., Any]) -> None:
    async with make_node(**FAST) as node:
        remote = node.remote("w1")
        task_id, lease = await running(node, remote, timeout_s=0.3)
        first = (await node.task(task_id))["attempts"][0]["deadline_at"]
        assert first is not None
        note = {**lease_of(lease), "phase": "run", "deadline_s": 3600, "deadline_at": "2099-01-01T00:00:00Z"}
        await remote.post("/w1/phase", {"notes": [note]})  # refused or ignored: either way nothing moves
        await remote.post("/w1/phase", {"notes": [{**lease_of(lease), "phase": "stop"}]})
        assert (await node.task(task_id))["attempts"][0]["deadline_at"] == first


def blob(n: int) -> dict[str, Any]:
    return {"blob": f"{n:04d}" + "x" * 59_996}  # 60,011 bytes as compact JSON


@pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])
async def test_results_past_the_byte_quota_are_413_and_the_attempt_still_completes(
        make_node: Callable[..., Any]) -> None:
    async with make_node(gateway={**AUTO, "max_result_bytes_per_attempt": 2**20}) as node:
        remote = node.remote("w1")
        task_id = await node.submit("noop")
        lease = await remote.leased()
        statuses = []
        for n in range(40):
            payload = blob(n)
            answer = await remote.post("/w1/results", {**lease_of(lease), "plugin": "probe", "sequence": n,
                                                        "idempotency_key": f"k{n}", "sha256": sha256(payload),
                                                        "final": False, "payload": payload})
            statuses.append(answer.status)
            if answer.status == 413:
                assert answer.code == "result_quota"
        assert statuses == [201] * 17 + [413] * 23
        again = blob(0)  # a batch sent again is no new batch: its acknowledgement, not a refusal
        answer = await remote.post("/w1/results", {**lease_of(lease), "plugin": "probe", "sequence": 0,
                                                    "idempotency_key": "k0", "sha256": sha256(again),
                                                    "final": False, "payload": again})
        assert answer.status == 200
        answer = await remote.post("/w1/finish", {"endings": [{**lease_of(lease), "status": "succeeded"}]})
        assert answer.body["endings"] == [{"attempt_id": lease["attempt_id"], "state": "completed"}]
        task = await node.task(task_id)
        assert len(task["results"]) == 17
