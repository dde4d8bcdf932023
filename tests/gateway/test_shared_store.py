"""Two gateways on one PostgreSQL store, a worker connected to the second: what an operator does through the
first (a submit, a cancel, a disable, a revoke) reaches the worker at once, not at its next acquire or renewal."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from .conftest import AUTO, MakeNode, Node, Remote, lease_of, open_control, sha256

# A bound for what must happen at once; far under the 30 s an acquire holds and the renewal interval.
AT_ONCE_S = 5.0


@pytest.fixture
def store_kind() -> str:
    return "postgres"


@asynccontextmanager
async def two_gateways(make_node: MakeNode, tmp_path: Path) -> AsyncIterator[tuple[Node, Node]]:
    async with make_node(node={"id": "gw-a"}, gateway=AUTO) as a, \
            make_node(node={"id": "gw-b", "state_dir": str(tmp_path / "var-b")}, gateway=AUTO) as b:
        yield a, b


async def submitted_through(a: Node, b: Node, worker: Remote) -> dict[str, Any]:
    """A task submitted on A, leased by an acquire parked on B: woken by A's submit, long before its wait_s."""
    await worker.acquire()  # enrolled
    answers = []

    async def park() -> None:
        answers.append(await worker.acquire(wait_s=30))

    async with anyio.create_task_group() as tg:
        tg.start_soon(park)
        with anyio.fail_after(AT_ONCE_S):
            while not len(b.daemon.gateway.parking):
                await anyio.sleep(0.01)
        task_id = await a.submit()
        with anyio.fail_after(AT_ONCE_S):
            while not answers:
                await anyio.sleep(0.01)
    (lease,) = answers[0].body["tasks"]
    assert lease["task"]["id"] == task_id
    return dict(lease)


async def test_a_task_submitted_on_one_gateway_wakes_an_acquire_parked_on_another(make_node: MakeNode,
                                                                                  tmp_path: Path) -> None:
    async with two_gateways(make_node, tmp_path) as (a, b):
        lease = await submitted_through(a, b, b.remote("w1"))
        task = await a.task(lease["task"]["id"])
        assert [(t["id"], t["node_id"]) for t in task["attempts"]] == [(lease["attempt_id"], "w1")]


async def test_a_revoke_through_one_gateway_cuts_off_the_worker_on_another_at_once(make_node: MakeNode,
                                                                                   tmp_path: Path) -> None:
    async with two_gateways(make_node, tmp_path) as (a, b):
        w1 = b.remote("w1")
        lease = await submitted_through(a, b, w1)
        control = await open_control(w1)
        assert await control.next() == ("worker", {"state": "enabled"})
        assert (await a.call("POST", "/v1/workers/w1/revoke")).status == 202
        assert await control.next(timeout_s=AT_ONCE_S) == ("cancel", {"attempt_id": lease["attempt_id"]})
        assert await control.next(timeout_s=AT_ONCE_S) == ("worker", {"state": "revoked"})
        assert await control.next(timeout_s=AT_ONCE_S) is None  # B ended the stream
        # B read the record again: its writes are refused as a revoked worker's, not renewed as a cancel
        renewed = await w1.post("/w1/renew", {"leases": [lease_of(lease)]})
        assert (renewed.status, renewed.code, renewed.body["error"]["reason"]) == (410, "lease_lost", "revoked")
        ended = await w1.post("/w1/finish", {"endings": [{**lease_of(lease), "status": "succeeded"}]})
        assert (ended.status, ended.body["error"]["reason"]) == (410, "revoked")
        refused = await w1.acquire()
        assert (refused.status, refused.code) == (403, "worker_revoked")
        assert (await b.task(lease["task"]["id"]))["state"] == "cancelling"


async def test_a_cancel_through_one_gateway_reaches_the_worker_on_another_at_once(make_node: MakeNode,
                                                                                 tmp_path: Path) -> None:
    async with two_gateways(make_node, tmp_path) as (a, b):
        w1 = b.remote("w1")
        lease = await submitted_through(a, b, w1)
        control = await open_control(w1)
        assert await control.next() == ("worker", {"state": "enabled"})
        assert (await a.call("POST", f"/v1/tasks/{lease['task']['id']}/cancel")).status == 202
        assert await control.next(timeout_s=AT_ONCE_S) == ("cancel", {"attempt_id": lease["attempt_id"]})


async def test_a_disable_through_one_gateway_answers_the_acquire_parked_on_another(make_node: MakeNode,
                                                                                  tmp_path: Path) -> None:
    async with two_gateways(make_node, tmp_path) as (a, b):
        w1 = b.remote("w1")
        await w1.acquire()  # enrolled
        control = await open_control(w1)
        assert await control.next() == ("worker", {"state": "enabled"})
        answers = []

        async def park() -> None:
            answers.append(await b.remote("w1").acquire(wait_s=30))

        async with anyio.create_task_group() as tg:
            tg.start_soon(park)
            with anyio.fail_after(AT_ONCE_S):
                while not len(b.daemon.gateway.parking):
                    await anyio.sleep(0.01)
            assert (await a.call("PATCH", "/v1/workers/w1", {"state": "disabled"})).status == 200
            assert await control.next(timeout_s=AT_ONCE_S) == ("worker", {"state": "disabled"})
            with anyio.fail_after(AT_ONCE_S):
                while not answers:
                    await anyio.sleep(0.01)
        assert answers[0].body == {**answers[0].body, "tasks": [], "worker_state": "disabled"}
        assert (await a.call("PATCH", "/v1/workers/w1", {"state": "enabled"})).status == 200
        assert await control.next(timeout_s=AT_ONCE_S) == ("worker", {"state": "enabled"})


async def test_notes_of_an_attempt_another_gateway_handed_out_publish_each_phase_once(make_node: MakeNode,
                                                                                       tmp_path: Path) -> None:
    async with two_gateways(make_node, tmp_path) as (a, b):
        phases: list[str] = []
        b.daemon.events.listen(lambda e: phases.append(e.data["phase"]) if e.name == "task.phase" else None)
        await a.submit()
        lease = await a.remote("w1").leased()
        on_b = b.remote("w1")
        for note in ({"phase": "initialize"}, {"phase": "run"}, {"phase": "run", "progress": {"fraction": 0.5}}):
            assert (await on_b.post("/w1/phase", {"notes": [{**lease_of(lease), **note}]})).body == {"lost": []}
        assert phases == ["initialize", "run"]


async def test_a_result_sent_again_through_another_gateway_is_answered_as_a_repeat(make_node: MakeNode,
                                                                                   tmp_path: Path) -> None:
    async with two_gateways(make_node, tmp_path) as (a, b):
        await a.submit()
        lease = await a.remote("w1").leased()
        payload = {"open": [22]}
        result = {**lease_of(lease), "plugin": "noop", "sequence": 0, "idempotency_key": "k-1",
                  "sha256": sha256(payload), "final": True, "payload": payload}
        assert (await a.remote("w1").post("/w1/results", result)).status == 201
        assert (await b.remote("w1").post("/w1/results", result)).status == 200  # the store found it stored
