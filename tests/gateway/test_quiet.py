"""An acquire whose worker was answered empty, with nothing woken since, parks without asking the store; any
wake, a different ask, or one hold's time makes it ask again."""

from __future__ import annotations

import time
from typing import Any

import anyio

from tidepool.model import NewTask

from .conftest import AUTO, MakeNode, Node


def count_store_acquires(node: Node) -> list[int]:
    """The real store's acquire, counted: [calls so far]."""
    store = node.daemon.gateway.store
    real = store.acquire
    calls = [0]

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await real(*args, **kwargs)

    store.acquire = counted  # type: ignore[method-assign]
    return calls


async def test_an_acquire_after_an_empty_answer_with_nothing_new_is_answered_without_the_store(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        w1, w2 = node.remote("w1"), node.remote("w2")
        calls = count_store_acquires(node)
        assert (await w1.acquire()).body["tasks"] == []
        assert calls == [1]
        assert (await w1.acquire()).body["tasks"] == []
        assert calls == [1]  # nothing was added or changed since: the store was not asked
        assert (await w1.acquire(types=["sleep"])).body["tasks"] == []
        assert calls == [2]  # another ask is a claim of its own
        assert (await w2.acquire()).body["tasks"] == []
        assert calls == [3]  # and another identity's
        task_id = await node.submit()
        (lease,) = (await w1.acquire()).body["tasks"]  # the submit's wake: asked again, and leased
        assert lease["task"]["id"] == task_id
        assert calls == [4]


async def test_a_parked_acquire_that_skipped_the_store_still_takes_a_task_submitted_meanwhile(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        w1 = node.remote("w1")
        calls = count_store_acquires(node)
        assert (await w1.acquire()).body["tasks"] == []
        answers: list[Any] = []

        async def park() -> None:
            answers.append(await w1.acquire(wait_s=30))

        async with anyio.create_task_group() as tg:
            tg.start_soon(park)
            with anyio.fail_after(5):
                while len(node.daemon.gateway.parking) == 0:
                    await anyio.sleep(0.01)
            assert calls == [1]  # parked at once, without a claim
            task_id = await node.submit()
            with anyio.fail_after(5):  # long before wait_s: the submit woke it
                while not answers:
                    await anyio.sleep(0.01)
        assert [t["task"]["id"] for t in answers[0].body["tasks"]] == [task_id]


async def test_a_task_that_came_free_without_a_wake_is_found_once_a_hold_has_passed(make_node: MakeNode) -> None:
    async with make_node(gateway={**AUTO, "max_wait_s": 0.3}) as node:
        w1 = node.remote("w1")
        calls = count_store_acquires(node)
        assert (await w1.acquire()).body["tasks"] == []
        task, _ = await node.daemon.store.add(NewTask("noop"), now=time.time())  # straight in: nobody woken
        assert (await w1.acquire()).body["tasks"] == []
        assert calls == [1]  # trusted: the store was not asked
        assert (await w1.acquire(wait_s=1)).body["tasks"] == []  # held 0.3 s (max_wait_s), still not asked
        (lease,) = (await w1.acquire()).body["tasks"]  # one hold after the empty answer: asked again
        assert lease["task"]["id"] == task.id
        assert calls == [2]


async def test_a_disabled_worker_that_skipped_the_store_is_answered_at_once(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        w1 = node.remote("w1")
        assert (await w1.acquire()).body["tasks"] == []
        answers: list[Any] = []

        async def park() -> None:
            answers.append(await w1.acquire(wait_s=30))

        async with anyio.create_task_group() as tg:
            tg.start_soon(park)
            with anyio.fail_after(5):
                while len(node.daemon.gateway.parking) == 0:
                    await anyio.sleep(0.01)
            answer = await node.call("PATCH", "/v1/workers/w1", {"state": "disabled"})
            assert answer.status == 200, answer
            with anyio.fail_after(5):
                while not answers:
                    await anyio.sleep(0.01)
        assert answers[0].body == {**answers[0].body, "tasks": [], "worker_state": "disabled"}
