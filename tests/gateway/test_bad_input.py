"""Bad input on /w1 is refused with the right 4xx naming what is wrong, and changes nothing; an acquire whose
client went away while it was held leases nothing."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from tidepool.events import Event

from .conftest import AUTO, MakeNode, Node, Remote, lease_of


async def nothing_changed(node: Node, task_id: str) -> None:
    task = await node.task(task_id)
    assert (task["state"], task["attempts"]) == ("pending", [])


@pytest.mark.parametrize(("path", "data", "status", "code", "names"), [
    ("/w1/acquire", b'{"types": ["noop"], "max": 1', 400, "invalid_json", ""),
    ("/w1/acquire", b'{"types": ["noop"], "max": 1, "worker_id": "w2"}', 400, "invalid_request", "worker_id"),
    ("/w1/acquire", b'{"types": ["noop"], "max": 100000}', 400, "invalid_request", "max"),
    ("/w1/acquire", b'{"types": ["noop"], "max": 1, "wait_s": -1}', 400, "invalid_request", "wait_s"),
    ("/w1/acquire", b'{"types": ["noop"], "max": true}', 400, "invalid_request", "max"),
    ("/w1/renew", b'{"leases": [{"attempt_id": "a", "lease_token": "t", "node_id": "w2"}]}', 400, "invalid_request",
     "node_id"),
    ("/w1/finish", b'{"endings": [{"attempt_id": "a", "lease_token": "t.0", "status": "completed"}]}', 400,
     "invalid_request", "status"),
    ("/w1/finish", b'{"endings": [{"attempt_id": "a", "lease_token": "t.0", "status": "succeeded", "scope": [1]}]}',
     400, "invalid_request", "scope"),
    ("/w1/acquire", b'{"types": ["noop"], "max": 1, "pad": "' + b"x" * (10 * 2**20) + b'"}', 413, "body_too_large",
     "KiB"),
])
async def test_bad_input_is_refused_and_leases_nothing(make_node: MakeNode, path: str, data: bytes, status: int,
                                                       code: str, names: str) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit()
        answer = await node.remote("w1").post(path, data=data)
        assert (answer.status, answer.code) == (status, code), answer
        assert names in answer.body["error"]["message"]
        await nothing_changed(node, task_id)


async def test_a_body_that_is_not_json_is_415(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit()
        answer = await node.remote("w1").post("/w1/acquire", data=b"types=noop", content_type="text/plain")
        assert (answer.status, answer.code) == (415, "unsupported_media_type")
        await nothing_changed(node, task_id)


async def test_a_held_acquire_whose_client_went_away_leases_nothing(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        await node.remote("w1").acquire()  # enrolled
        leaving = node.remote("w1")
        request = asyncio.ensure_future(leaving.acquire(wait_s=30))
        with anyio.fail_after(5):
            while not len(node.daemon.gateway.parking):
                await anyio.sleep(0.01)
        request.cancel()  # the client closes its connection
        await leaving.session.close()
        with anyio.fail_after(5):
            while len(node.daemon.gateway.parking):
                await anyio.sleep(0.01)
        task_id = await node.submit()
        await anyio.sleep(0.2)  # a wake the parked acquire would have answered by now
        await nothing_changed(node, task_id)
        assert len((await Remote.leased(node.remote("w1")))["task"]["id"]) == 32


async def test_a_batch_naming_one_attempt_twice_is_refused_and_its_ending_then_publishes_task_finished(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit()
        w1 = node.remote("w1")
        held = lease_of(await w1.leased())
        seen: list[Event] = []
        node.daemon.events.listen(seen.append)
        twice = {"/w1/renew": {"leases": [held, held]},
                 "/w1/phase": {"notes": [{**held, "phase": "run"}, {**held, "phase": "run"}]},
                 "/w1/finish": {"endings": [{**held, "status": "succeeded"}, {**held, "status": "failed"}]}}
        for path, body in twice.items():
            answer = await w1.post(path, body)
            field = next(iter(body))
            assert (answer.status, answer.code) == (400, "invalid_request"), answer
            assert answer.body["error"]["message"].startswith(field) and "twice" in answer.body["error"]["message"]
        assert (await node.task(task_id))["state"] == "leased"  # not even the phase note landed
        ended = await w1.post("/w1/finish", {"endings": [{**held, "status": "succeeded"}]})
        assert ended.body == {"endings": [{"attempt_id": held["attempt_id"], "state": "completed"}]}
        assert [e.data["state"] for e in seen if e.name == "task.finished"] == ["completed"]
