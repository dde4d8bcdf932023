"""Errors say nothing about the inside: a remote worker, and an API caller without the token, read that the
store is unavailable and nothing of where or why (the log has it, once); a lease token naming a task that is
not its attempt's is answered as an attempt the caller does not hold, and publishes nothing for that task."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tidepool.errors import StoreUnavailable
from tidepool.events import Event
from tidepool.model import sha256_of

from ..w1_client import Answer, Remote
from .conftest import AUTO, MakeNode, lease_of

UNKNOWN_TASK = "0" * 26
TOKEN = "the-api-token-of-this-gateway-0123456789"


async def forged_writes(w1: Remote, lease: dict[str, Any], task_id: str, *, phase: str = "run") -> list[Answer]:
    """Every write of the protocol behind `lease`'s attempt with a token naming `task_id` instead."""
    forged = {"attempt_id": lease["attempt_id"], "lease_token": f"{task_id}.{lease['lease_token'].split('.')[1]}"}
    payload = {"x": 1}
    return [
        await w1.post("/w1/renew", {"leases": [forged]}),
        await w1.post("/w1/phase", {"notes": [{**forged, "phase": phase}]}),
        await w1.post("/w1/results", {**forged, "plugin": "p", "sequence": 0, "idempotency_key": "k",
                                      "sha256": sha256_of(payload), "final": True, "payload": payload}),
        await w1.post("/w1/finish", {"endings": [{**forged, "status": "failed"}]}),
    ]


@pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])
@pytest.mark.parametrize("known", [True, False], ids=["handed_out_here", "handed_out_elsewhere"])
async def test_a_token_naming_another_task_is_answered_as_an_unknown_one_and_publishes_nothing(
        make_node: MakeNode, known: bool) -> None:
    async with make_node(gateway=AUTO) as node:
        mine = await node.submit()
        other = await node.submit()  # exists, pending: a token naming it must not say so
        w1 = node.remote("w1")
        lease = await w1.leased()
        assert lease["task"]["id"] == mine
        seen: list[Event] = []
        node.daemon.events.listen(seen.append)

        async def writes(task_id: str) -> list[Answer]:
            if not known:  # as after a restart, or from another gateway of the store: the store is asked
                node.daemon.gateway.attempts.drop(lease["attempt_id"])
            return await forged_writes(w1, lease, task_id)

        naming_other, naming_none = await writes(other), await writes(UNKNOWN_TASK)
        assert naming_other == naming_none
        renewed, noted, wrote, ended = naming_other
        assert renewed.body["leases"] == [{"attempt_id": lease["attempt_id"], "status": "lost",
                                           "reason": "superseded"}]
        assert noted.body == {"lost": [lease["attempt_id"]]}
        assert (wrote.status, wrote.code, wrote.body["error"]["reason"]) == (410, "lease_lost", "superseded")
        assert other not in wrote.body["error"]["message"]
        assert ended.body == {"endings": [{"attempt_id": lease["attempt_id"], "lost": "superseded"}]}
        assert [e.name for e in seen if e.name == "task.lease_lost"] == []
        assert (await node.task(other))["state"] == "pending"
        held = await w1.post("/w1/renew", {"leases": [lease_of(lease)]})
        assert held.body["leases"][0]["status"] == "held", "the caller's own lease is untouched"


async def test_a_refused_write_while_the_store_cannot_be_read_is_store_unavailable_and_publishes_nothing(
        make_node: MakeNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attempt this gateway did not hand out, behind a token naming another task: the store fences the write
    and refuses it, then cannot say whether that task holds the attempt. Nothing is published for that task
    (another's), and the gateway does not take the attempt as that task's."""
    async with make_node(gateway=AUTO) as node:
        await node.submit()
        other = await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        gateway = node.daemon.gateway
        gateway.attempts.drop(lease["attempt_id"])  # as after a restart, or from another gateway of the store
        seen: list[Event] = []
        node.daemon.events.listen(seen.append)

        async def unreadable(task_id: str) -> Any:
            raise StoreUnavailable("store: the database is locked")

        with monkeypatch.context() as patched:
            patched.setattr(gateway.store, "get", unreadable)  # only the read after the refusal fails
            answers = await forged_writes(w1, lease, other, phase="prepare")
        assert [(a.status, a.code) for a in answers] == [(503, "store_unavailable")] * 4, answers
        assert [e.name for e in seen if e.name == "task.lease_lost"] == []
        assert gateway.attempts.get(lease["attempt_id"]) is None
        held = await w1.post("/w1/renew", {"leases": [lease_of(lease)]})
        assert held.body["leases"][0]["status"] == "held"


async def call(node: Any, method: str, path: str, *, token: str | None = None, body: Any = None) -> Answer:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http, http.request(method, node.api + path, json=body,
                                                             headers=headers) as r:
        return Answer(r.status, await r.json(content_type=None))


def says_nothing_of_the_inside(answer: Answer, tmp_path: Path) -> None:
    text = str(answer.body)
    for inside in (str(tmp_path), "gateway.db", "sqlite", "deleted", "replaced"):
        assert inside not in text, answer


async def test_a_store_failure_reaches_workers_and_callers_without_the_token_as_store_unavailable_only(
        make_node: MakeNode, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    token_file = tmp_path / "api.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    async with make_node(gateway=AUTO, api={"token_file": str(token_file)}) as node:
        await call(node, "POST", "/v1/tasks", token=TOKEN, body={"type": "noop"})
        w1 = node.remote("w1")
        lease = await w1.leased()
        (tmp_path / "gateway.db").unlink()  # the store's file gone: every write fails, naming it
        with caplog.at_level(logging.WARNING, logger="tidepool.http"):
            for _ in range(2):
                renewed = await w1.post("/w1/renew", {"leases": [lease_of(lease)]})
                assert (renewed.status, renewed.code) == (503, "store_unavailable"), renewed
                says_nothing_of_the_inside(renewed, tmp_path)
        logged = [r.getMessage() for r in caplog.records if r.name == "tidepool.http"]
        assert len(logged) == 1 and "deleted or replaced" in logged[0] and "/w1/renew" in logged[0], logged

        ready = await call(node, "GET", "/readyz")
        assert (ready.status, ready.body) == (503, {"status": "unavailable", "reason": "store unavailable"})
        told = await call(node, "GET", "/readyz", token=TOKEN)
        assert told.status == 503 and "deleted or replaced" in told.body["reason"], told
        refused = await call(node, "POST", "/v1/tasks", token=TOKEN, body={"type": "noop"})
        assert refused.status == 503 and "deleted or replaced" in refused.body["error"]["message"], refused


async def test_an_api_without_a_token_configured_tells_no_caller_the_inside(make_node: MakeNode,
                                                                            tmp_path: Path) -> None:
    async with make_node(gateway=AUTO) as node:
        (tmp_path / "gateway.db").unlink()
        refused = await call(node, "POST", "/v1/tasks", body={"type": "noop"})
        assert (refused.status, refused.body["error"]["code"]) == (503, "store_unavailable"), refused
        says_nothing_of_the_inside(refused, tmp_path)
        ready = await call(node, "GET", "/readyz")
        assert ready.body == {"status": "unavailable", "reason": "store unavailable"}


@pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])
async def test_another_workers_attempt_is_answered_as_an_unknown_one_and_publishes_nothing(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        await node.submit()
        w1, w2 = node.remote("w1"), node.remote("w2")
        lease = await w1.leased()
        seen: list[Event] = []
        node.daemon.events.listen(seen.append)
        task_id = lease["lease_token"].split(".")[0]
        unknown = {**lease, "attempt_id": "0" * 26}

        def shown(answers: list[Answer], attempt_id: str) -> str:
            return str(answers).replace(attempt_id, "ATTEMPT")

        others = await forged_writes(w2, lease, task_id)  # w1's attempt and its token, from w2
        none = await forged_writes(w2, unknown, task_id)
        assert shown(others, lease["attempt_id"]) == shown(none, unknown["attempt_id"])
        assert [e.name for e in seen if e.data.get("task_id") == task_id] == []
