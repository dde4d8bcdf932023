"""The worker protocol over real mutual TLS against a gateway node: leases, renewals, results, endings, and
who may write behind which lease."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tidepool.gateway.schemas import AcquireIn

from .conftest import AUTO, MakeNode, lease_of, sha256

pytestmark = pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])


async def test_a_task_runs_remotely_with_the_workers_identity_as_its_node(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit()
        w1 = node.remote("w1")
        acquired = await w1.acquire()
        assert acquired.status == 200, acquired
        assert acquired.body["worker_state"] == "enabled"
        assert acquired.body["lease_s"] == node.daemon.settings.lease.duration_s
        assert acquired.body["renew_after_s"] == node.daemon.settings.lease.renew_every_s
        (lease,) = acquired.body["tasks"]
        assert lease["task"]["id"] == task_id
        note = {**lease_of(lease), "phase": "run", "progress": {"fraction": 0.5, "message": "half"}}
        assert (await w1.post("/w1/phase", {"notes": [note]})).body == {"lost": []}
        renewed = await w1.post("/w1/renew", {"leases": [lease_of(lease)]})
        assert renewed.body["leases"][0]["status"] == "held", renewed
        finished = await w1.post("/w1/finish", {"endings": [{**lease_of(lease), "status": "succeeded"}]})
        assert finished.body == {"endings": [{"attempt_id": lease["attempt_id"], "state": "completed"}]}
        task = await node.task(task_id)
        assert task["state"] == "completed"
        assert task["node_id"] == "w1"
        assert [a["node_id"] for a in task["attempts"]] == ["w1"]


async def test_the_gateway_publishes_the_events_of_remote_attempts(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        seen: list[tuple[str, Any]] = []
        node.daemon.events.listen(lambda e: seen.append((e.name, e.data.get("worker_id"))))
        task_id = await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        note = {**lease_of(lease), "phase": "initialize"}
        await w1.post("/w1/phase", {"notes": [note]})
        await w1.post("/w1/phase", {"notes": [{**note, "phase": "run", "progress": {"fraction": 1.0}}]})
        await w1.post("/w1/finish", {"endings": [{**lease_of(lease), "status": "succeeded"}]})
        names = [name for name, worker in seen if worker == "w1"]
        assert names == ["worker.enrolled", "task.leased", "task.phase", "task.phase", "task.progress", "task.finished"]
        assert (await node.task(task_id))["state"] == "completed"


async def test_an_acquire_sent_again_with_its_request_id_answers_the_same_lease(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        await node.submit()
        await node.submit()
        w1 = node.remote("w1")
        first = await w1.acquire(request_id="r-1")
        again = await w1.acquire(request_id="r-1")
        assert first.status == again.status == 200
        assert len(first.body["tasks"]) == 1
        assert again.body["tasks"] == first.body["tasks"]
        other = await w1.acquire(request_id="r-2")
        assert other.body["tasks"][0]["attempt_id"] != first.body["tasks"][0]["attempt_id"]


@pytest.mark.parametrize("request_id", [None, "r-1"])
async def test_what_an_acquire_leased_as_its_client_left_goes_back_to_the_queue_at_once(
        make_node: MakeNode, request_id: str | None) -> None:
    async with make_node(gateway=AUTO) as node:
        w1 = node.remote("w1")
        await w1.acquire()  # enrolled
        task_id = await node.submit()
        gateway = node.daemon.gateway
        worker = await gateway.store.get_worker("w1")
        there = iter([True])  # the client is there when the claim begins, gone once it is answered

        answer = await gateway.acquire(worker, AcquireIn(types=["noop"], request_id=request_id), version=None,
                                       gone=lambda: not next(there, False), on_gone=lambda cancel: lambda: None)
        assert answer["tasks"] == []
        task = await node.task(task_id)
        assert (task["state"], [a["status"] for a in task["attempts"]]) == ("pending", ["interrupted"])
        assert (await w1.leased())["task"]["id"] == task_id  # not held for a repeat that may never come


async def test_an_acquire_holds_for_wait_s_then_answers_no_task(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        w1 = node.remote("w1")
        started = anyio.current_time()
        answer = await w1.acquire(wait_s=0.5)
        assert answer.status == 200
        assert answer.body["tasks"] == []
        assert anyio.current_time() - started >= 0.5  # it held: the answer was not immediate


async def test_a_task_submitted_while_an_acquire_is_parked_goes_to_it(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        w1 = node.remote("w1")
        answers: list[Any] = []

        async def park() -> None:
            answers.append(await w1.acquire(wait_s=30))

        async with anyio.create_task_group() as tg:
            tg.start_soon(park)
            with anyio.fail_after(5):
                while len(node.daemon.gateway.parking) == 0:
                    await anyio.sleep(0.01)
            task_id = await node.submit()
            with anyio.fail_after(5):  # long before wait_s: the submit woke it
                while not answers:
                    await anyio.sleep(0.01)
        assert [t["task"]["id"] for t in answers[0].body["tasks"]] == [task_id]


async def test_a_repeat_of_a_request_id_ends_the_first_hold_and_loses_no_wake(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        w1, w1_again, w2 = node.remote("w1"), node.remote("w1"), node.remote("w2")
        parking = node.daemon.gateway.parking
        answers: dict[str, Any] = {}

        async def acquire(name: str, remote: Any, types: list[str], request_id: str | None = None) -> None:
            answers[name] = await remote.acquire(wait_s=30, types=types, request_id=request_id)

        async def held(n: int) -> None:
            with anyio.fail_after(5):
                while len(parking) != n:
                    await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(acquire, "first", w1, ["noop"], "r-1")
            await held(1)
            tg.start_soon(acquire, "w2", w2, ["sleep"])
            await held(2)
            tg.start_soon(acquire, "repeat", w1_again, ["noop"], "r-1")
            with anyio.fail_after(5):  # the repeat ended the first one's hold, long before its wait_s
                while "first" not in answers:
                    await anyio.sleep(0.01)
            assert answers["first"].body["tasks"] == []
            await held(2)  # the repeat holds in its place
            task_id = await node.submit("sleep")  # only w2 may take it
            with anyio.fail_after(5):
                while "w2" not in answers:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert [t["task"]["id"] for t in answers["w2"].body["tasks"]] == [task_id]


async def test_results_are_checked_against_their_sha256_and_stored_once_by_key(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        payload = {"ports": [80, 443], "host": "é"}
        result = {**lease_of(lease), "plugin": "noop", "sequence": 0, "idempotency_key": "k-1",
                  "sha256": sha256(payload), "final": True, "payload": payload}
        wrong = await w1.post("/w1/results", {**result, "sha256": sha256({"other": 1})})
        assert (wrong.status, wrong.code) == (400, "invalid_request")
        assert "sha256" in wrong.body["error"]["message"]
        assert (await node.task(task_id))["results"] == []
        assert (await w1.post("/w1/results", result)).status == 201
        repeat = await w1.post("/w1/results", result)
        assert repeat.status == 200
        assert repeat.body["sha256"] == sha256(payload)
        other = {"ports": [22]}
        conflict = await w1.post("/w1/results", {**result, "payload": other, "sha256": sha256(other)})
        assert conflict.status == 409, conflict
        assert [r["payload"] for r in (await node.task(task_id))["results"]] == [payload]


async def test_renew_answers_cancel_once_the_task_is_cancelled(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        assert (await node.call("POST", f"/v1/tasks/{task_id}/cancel")).body == {"state": "cancelling"}
        renewed = await w1.post("/w1/renew", {"leases": [lease_of(lease)]})
        assert renewed.body["leases"] == [{"attempt_id": lease["attempt_id"], "status": "cancel"}]
        finished = await w1.post("/w1/finish", {"endings": [{**lease_of(lease), "status": "cancelled"}]})
        assert finished.body["endings"][0]["state"] == "cancelled"


async def test_one_worker_cannot_renew_write_or_finish_anothers_attempt_with_its_token(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit()
        w1, w2 = node.remote("w1"), node.remote("w2")
        lease = await w1.leased()
        stolen = lease_of(lease)
        renewed = await w2.post("/w1/renew", {"leases": [stolen]})
        assert renewed.body["leases"] == [{"attempt_id": lease["attempt_id"], "status": "lost", "reason": "superseded"}]
        noted = await w2.post("/w1/phase", {"notes": [{**stolen, "phase": "run"}]})
        assert noted.body == {"lost": [lease["attempt_id"]]}
        payload = {"forged": True}
        wrote = await w2.post("/w1/results", {**stolen, "plugin": "noop", "sequence": 0, "idempotency_key": "x",
                                              "sha256": sha256(payload), "final": True, "payload": payload})
        assert (wrote.status, wrote.code, wrote.body["error"]["reason"]) == (410, "lease_lost", "superseded")
        ended = await w2.post("/w1/finish", {"endings": [{**stolen, "status": "failed"}]})
        assert ended.body == {"endings": [{"attempt_id": lease["attempt_id"], "lost": "superseded"}]}
        task = await node.task(task_id)
        assert (task["state"], task["phase"], task["results"]) == ("leased", None, [])
        # the owner's lease is untouched
        assert (await w1.post("/w1/renew", {"leases": [stolen]})).body["leases"][0]["status"] == "held"


async def test_a_worker_cannot_take_the_result_keys_of_a_task_it_does_not_hold(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_a = await node.submit()
        w1, w2 = node.remote("w1"), node.remote("w2")
        lease_a = await w1.leased()
        task_b = await node.submit()
        lease_b = await w2.leased()
        assert (lease_a["task"]["id"], lease_b["task"]["id"]) == (task_a, task_b)

        def result(lease: dict[str, Any], key: str, payload: Any) -> dict[str, Any]:
            return {**lease_of(lease), "plugin": "noop", "sequence": 0, "idempotency_key": key,
                    "sha256": sha256(payload), "final": False, "payload": payload}

        planted = {"planted": "by w1"}
        for key in (f"{task_b}:report", f"{task_b}:second", f"{lease_b['attempt_id']}:noop:0"):
            assert (await w1.post("/w1/results", result(lease_a, key, planted))).status == 201
        real = {"found": [443]}
        taken = await w2.post("/w1/results", result(lease_b, f"{task_b}:report", real))
        assert (taken.status, taken.body["attempt_id"]) == (201, lease_b["attempt_id"]), taken
        for key in (f"{task_b}:second", f"{lease_b['attempt_id']}:noop:0"):  # w1's content, under its keys
            same = await w2.post("/w1/results", result(lease_b, key, planted))
            assert (same.status, same.body["attempt_id"]) == (201, lease_b["attempt_id"]), same
        assert {r["attempt_id"] for r in (await node.task(task_b))["results"]} == {lease_b["attempt_id"]}
        assert [r["idempotency_key"] for r in (await node.task(task_a))["results"]] == [
            f"{task_a}:{task_b}:report", f"{task_a}:{task_b}:second", f"{task_a}:{lease_b['attempt_id']}:noop:0"]


async def test_a_result_key_holds_across_the_attempts_of_its_task(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit()
        w1 = node.remote("w1")
        first = await w1.leased()
        payload = {"found": [22]}
        result = {"plugin": "noop", "sequence": 0, "idempotency_key": "report", "sha256": sha256(payload),
                  "final": True, "payload": payload}
        stored = await w1.post("/w1/results", {**lease_of(first), **result})
        assert (stored.status, stored.body["idempotency_key"]) == (201, f"{task_id}:report")
        ended = await w1.post("/w1/finish", {"endings": [{**lease_of(first), "status": "interrupted"}]})
        assert ended.body["endings"][0]["state"] == "pending", ended
        second = await w1.leased()
        again = await w1.post("/w1/results", {**lease_of(second), **result})
        assert (again.status, again.body["attempt_id"]) == (200, first["attempt_id"])  # the same key of its task
        assert len((await node.task(task_id))["results"]) == 1
