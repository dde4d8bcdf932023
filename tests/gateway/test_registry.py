"""The registry's states as remote workers meet them: manual enrollment, disable (a drain), revoke (final), and
changes that reach a connected worker on its control stream at once."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tidepool.gateway.parking import MAX_HELD_PER_WORKER

from .conftest import AUTO, MakeNode, lease_of, open_control

pytestmark = pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])


async def test_an_unknown_worker_waits_pending_until_an_operator_enables_it(make_node: MakeNode) -> None:
    async with make_node() as node:
        await node.submit()
        w1 = node.remote("w1")
        refused = await w1.acquire()
        assert (refused.status, refused.code) == (403, "worker_pending")
        assert (await w1.post("/w1/renew", {"leases": []})).code == "worker_pending"
        listed = await node.call("GET", "/v1/workers")
        assert [(w["id"], w["state"], w["live"]) for w in listed.body["workers"]] == [("w1", "pending", 0)]
        (cert,) = listed.body["workers"][0]["fingerprints"]
        assert len(cert["fingerprint"]) == 64
        await node.enable("w1")
        served = await w1.acquire()
        assert served.status == 200 and len(served.body["tasks"]) == 1
        worker = (await node.call("GET", "/v1/workers/w1")).body
        assert (worker["state"], worker["live"]) == ("enabled", 1)
        assert (await node.call("GET", "/v1/workers/nobody")).status == 404


async def test_a_disabled_worker_is_answered_at_once_with_no_task_and_its_running_attempt_finishes(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        first = await node.submit()
        await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        control = await open_control(w1)
        assert await control.next() == ("worker", {"state": "enabled"})
        patched = await node.call("PATCH", "/v1/workers/w1", {"state": "disabled"})
        assert (patched.status, patched.body["state"]) == (200, "disabled")
        assert await control.next() == ("worker", {"state": "disabled"})
        with anyio.fail_after(5):  # wait_s 30, but a disabled worker's acquire answers at once
            answer = await w1.acquire(wait_s=30)
        assert answer.body["tasks"] == [] and answer.body["worker_state"] == "disabled"
        renewed = await w1.post("/w1/renew", {"leases": [lease_of(lease)]})
        assert renewed.body == {"leases": [{"attempt_id": lease["attempt_id"], "status": "held",
                                            "lease_expires_at": renewed.body["leases"][0]["lease_expires_at"]}],
                                "worker_state": "disabled"}
        ended = await w1.post("/w1/finish", {"endings": [{**lease_of(lease), "status": "succeeded"}]})
        assert ended.body["endings"][0]["state"] == "completed"
        assert (await node.task(first))["state"] == "completed"


async def test_a_parked_acquire_of_a_worker_disabled_meanwhile_answers_at_once(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        w1 = node.remote("w1")
        await w1.acquire()  # enrolled
        answers = []

        async def park() -> None:
            answers.append(await w1.acquire(wait_s=30))

        async with anyio.create_task_group() as tg:
            tg.start_soon(park)
            with anyio.fail_after(5):
                while not len(node.daemon.gateway.parking):
                    await anyio.sleep(0.01)
            await node.call("PATCH", "/v1/workers/w1", {"state": "disabled"})
            with anyio.fail_after(5):
                while not answers:
                    await anyio.sleep(0.01)
        assert answers[0].body["worker_state"] == "disabled"


async def test_a_revoke_cancels_the_workers_attempts_closes_its_stream_and_refuses_it_for_good(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        control = await open_control(w1)
        assert await control.next() == ("worker", {"state": "enabled"})
        revoked = await node.call("POST", "/v1/workers/w1/revoke")
        assert (revoked.status, revoked.body["state"]) == (202, "revoked")
        assert await control.next() == ("cancel", {"attempt_id": lease["attempt_id"]})
        assert await control.next() == ("worker", {"state": "revoked"})
        assert await control.next() is None  # the stream ended
        assert (await node.task(task_id))["state"] == "cancelling"
        refused = await w1.acquire()
        assert (refused.status, refused.code) == (403, "worker_revoked")
        write = await w1.post("/w1/renew", {"leases": [lease_of(lease)]})
        assert (write.status, write.code, write.body["error"]["reason"]) == (410, "lease_lost", "revoked")
        again = await node.call("PATCH", "/v1/workers/w1", {"state": "enabled"})
        assert again.status == 409
        assert (await node.call("GET", "/v1/workers/w1")).body["state"] == "revoked"


async def test_a_revoked_worker_may_still_say_its_cancelled_attempt_stopped_and_nothing_else(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        first, second = await node.submit(), await node.submit()
        w1 = node.remote("w1")
        leases = [await w1.leased(), await w1.leased()]
        assert (await node.call("POST", "/v1/workers/w1/revoke")).status == 202
        succeeded = await w1.post("/w1/finish", {"endings": [{**lease_of(leases[0]), "status": "succeeded"}]})
        assert (succeeded.status, succeeded.code, succeeded.body["error"]["reason"]) == (410, "lease_lost", "revoked")
        mixed = await w1.post("/w1/finish", {"endings": [{**lease_of(leases[0]), "status": "succeeded"},
                                                         {**lease_of(leases[1]), "status": "cancelled"}]})
        assert mixed.status == 200, mixed
        assert mixed.body["endings"] == [{"attempt_id": leases[0]["attempt_id"], "lost": "revoked"},
                                         {"attempt_id": leases[1]["attempt_id"], "state": "cancelled"}]
        assert [(await node.task(t))["state"] for t in (first, second)] == ["cancelling", "cancelled"]


async def test_a_cancel_reaches_the_workers_control_stream_at_once(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        control = await open_control(w1)
        assert await control.next() == ("worker", {"state": "enabled"})
        await node.call("POST", f"/v1/tasks/{task_id}/cancel")
        assert await control.next() == ("cancel", {"attempt_id": lease["attempt_id"]})


async def test_remote_workers_are_listed_among_the_nodes_and_their_slots_serve_a_submits_tags(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        refused = await node.call("POST", "/v1/tasks", {"type": "noop", "required_tags": ["gpu"]})
        assert refused.status == 400
        w1 = node.remote("w1")
        assert (await w1.acquire(slots=[["gpu", "x64"]])).status == 200
        nodes = (await node.call("GET", "/v1/nodes")).body["nodes"]
        remote = [n for n in nodes if n["kind"] == "remote"]
        assert [(n["node_id"], n["alive"], n["tags"]) for n in remote] == [("w1", True, [["gpu", "x64"]])]
        node.daemon.gateway.registry._slots = (-1e9, [])  # the one-second cache of the slots, read again
        assert (await node.call("POST", "/v1/tasks", {"type": "noop", "required_tags": ["gpu"]})).status == 201


@pytest.mark.parametrize("body", [{"state": "revoked"}, {"max_concurrent_tasks": -1}, {"colour": "red"},
                                  {"task_types": []}])
async def test_a_bad_patch_of_a_worker_is_refused_naming_the_field(make_node: MakeNode, body: object) -> None:
    async with make_node(gateway=AUTO) as node:
        await node.remote("w1").acquire()
        answer = await node.call("PATCH", "/v1/workers/w1", body)
        assert (answer.status, answer.code) == (400, "invalid_request"), answer
        assert (await node.call("GET", "/v1/workers/w1")).body["state"] == "enabled"


async def test_a_worker_at_its_cap_is_held_until_one_of_its_attempts_ends(make_node: MakeNode) -> None:
    async with make_node(gateway={**AUTO, "max_concurrent_tasks": 1}) as node:
        await node.submit()
        second = await node.submit()
        w1 = node.remote("w1")
        first = (await w1.acquire(max=4)).body["tasks"]
        assert len(first) == 1  # its cap, though it asked for four and two wait
        answers = []

        async def park() -> None:
            answers.append(await node.remote("w1").acquire(max=4, wait_s=30))

        async with anyio.create_task_group() as tg:
            tg.start_soon(park)
            with anyio.fail_after(5):
                while not len(node.daemon.gateway.parking):
                    await anyio.sleep(0.01)
            await w1.post("/w1/finish", {"endings": [{**lease_of(first[0]), "status": "succeeded"}]})
            with anyio.fail_after(5):  # long before wait_s: its ending made room
                while not answers:
                    await anyio.sleep(0.01)
        assert [t["task"]["id"] for t in answers[0].body["tasks"]] == [second]


async def test_a_pending_workers_every_write_is_worker_pending_finish_included(make_node: MakeNode) -> None:
    async with make_node() as node:
        w1 = node.remote("w1")
        assert (await w1.acquire()).code == "worker_pending"  # recorded pending
        held = {"attempt_id": "a" * 32, "lease_token": f"{'0' * 26}.{'f' * 32}"}
        for path, body in (("/w1/renew", {"leases": [held]}), ("/w1/phase", {"notes": [{**held, "phase": "run"}]}),
                           ("/w1/finish", {"endings": [{**held, "status": "succeeded"}]})):
            answer = await w1.post(path, body)
            assert (answer.status, answer.code) == (403, "worker_pending"), (path, answer)


async def test_a_pending_workers_connection_is_closed_after_its_answer(make_node: MakeNode) -> None:
    async with make_node() as node:
        w1 = node.remote("w1")
        async with w1.session.post(w1.url + "/w1/acquire", json={"types": ["noop"], "max": 1, "wait_s": 0}) as r:
            assert r.status == 403
            assert r.headers.get("Connection") == "close"  # it holds no connection it cannot use


async def test_one_worker_holds_a_bounded_number_of_acquires(make_node: MakeNode) -> None:
    # each held acquire is a connection of its own: room for them all, and one more
    async with make_node(gateway={**AUTO, "max_connections_per_worker": MAX_HELD_PER_WORKER + 1}) as node:
        parking = node.daemon.gateway.parking
        w1 = node.remote("w1")
        answers: list[Any] = []

        async def hold() -> None:
            answers.append(await w1.acquire(wait_s=30))

        async with anyio.create_task_group() as tg:
            for _ in range(MAX_HELD_PER_WORKER):
                tg.start_soon(hold)
            with anyio.fail_after(10):
                while len(parking) < MAX_HELD_PER_WORKER:
                    await anyio.sleep(0.01)
            with anyio.fail_after(5):  # one more is answered at once, not held
                extra = await w1.acquire(wait_s=30)
            assert (extra.status, extra.body["tasks"]) == (200, [])
            assert len(parking) == MAX_HELD_PER_WORKER
            tg.cancel_scope.cancel()
