"""The events a gateway publishes of remote attempts: what the worker protocol tells (phases as they change,
progress without a plugin, results with theirs, endings) and a lease that expired under its worker, once."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tidepool.gateway.events import PROGRESS_EVERY_S

from .conftest import AUTO, MakeNode, lease_of, sha256

pytestmark = pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])


async def test_a_remote_attempts_progress_has_no_plugin_and_its_result_has_its_own(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        seen: list[tuple[str, dict[str, Any]]] = []
        node.daemon.events.listen(lambda e: seen.append((e.name, e.data)) if e.data.get("worker_id") == "w1" else None)
        await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        run = {**lease_of(lease), "phase": "run"}
        await w1.post("/w1/phase", {"notes": [run]})
        await w1.post("/w1/phase", {"notes": [{**run, "progress": {"fraction": 0.25, "message": "m"}}]})
        payload = {"open": [22]}
        result = {**lease_of(lease), "plugin": "portscan", "sequence": 0, "idempotency_key": "k-1",
                  "sha256": sha256(payload), "final": True, "payload": payload}
        assert (await w1.post("/w1/results", result)).status == 201
        assert [name for name, _ in seen] == ["worker.enrolled", "task.leased", "task.phase", "task.progress",
                                             "task.result"]  # the phase repeated with the progress: said once
        assert [d["plugin"] for name, d in seen if name == "task.progress"] == [None]
        assert seen[-1][1]["plugin"] == "portscan"


async def test_a_flood_of_progress_notes_publishes_one_progress_a_second_and_the_store_keeps_the_latest(
        make_node: MakeNode, monkeypatch: pytest.MonkeyPatch) -> None:
    async with make_node(gateway=AUTO) as node:
        fractions: list[float] = []
        node.daemon.events.listen(lambda e: fractions.append(e.data["fraction"]) if e.name == "task.progress" else None)
        task_id = await node.submit()
        w1 = node.remote("w1")
        run = {**lease_of(await w1.leased()), "phase": "run"}
        gateway = node.daemon.gateway
        now = gateway._clock()
        monkeypatch.setattr(gateway, "_clock", lambda: now)  # the gateway's clock, stopped for the flood
        for step in range(1, 21):
            noted = await w1.post("/w1/phase", {"notes": [{**run, "progress": {"fraction": step / 100}}]})
            assert noted.body == {"lost": []}
        assert fractions == [0.01]
        assert (await node.task(task_id))["progress"]["fraction"] == 0.2
        now += PROGRESS_EVERY_S
        await w1.post("/w1/phase", {"notes": [{**run, "progress": {"fraction": 0.3}}]})
        assert fractions == [0.01, 0.3]


async def test_a_lease_that_expired_under_its_worker_is_published_once(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO, lease={"duration_s": 0.5, "renew_every_s": 0.2}) as node:
        lost: list[dict[str, Any]] = []
        node.daemon.events.listen(lambda e: lost.append(e.data) if e.name == "task.lease_lost" else None)
        task_id = await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        await anyio.sleep(node.daemon.settings.lease.duration_s + 0.1)  # the worker did not renew in time
        renewed = await w1.post("/w1/renew", {"leases": [lease_of(lease)]})
        assert renewed.body["leases"][0] == {"attempt_id": lease["attempt_id"], "status": "lost", "reason": "expired"}
        ended = await w1.post("/w1/finish", {"endings": [{**lease_of(lease), "status": "succeeded"}]})
        assert ended.body["endings"] == [{"attempt_id": lease["attempt_id"], "lost": "expired"}]
        assert lost == [{"task_id": task_id, "worker_id": "w1", "attempt_id": lease["attempt_id"], "type": "noop",
                         "reason": "expired"}]


async def test_an_ending_sent_again_after_its_answer_was_lost_is_answered_as_the_first_time(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        lost: list[dict[str, Any]] = []
        node.daemon.events.listen(lambda e: lost.append(e.data) if e.name == "task.lease_lost" else None)
        await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        ending = {"endings": [{**lease_of(lease), "status": "succeeded"}]}
        first = await w1.post("/w1/finish", ending)
        again = await w1.post("/w1/finish", ending)
        assert first.body == again.body == {"endings": [{"attempt_id": lease["attempt_id"], "state": "completed"}]}
        other = await w1.post("/w1/finish", {"endings": [{**lease_of(lease), "status": "failed"}]})
        assert other.body["endings"] == [{"attempt_id": lease["attempt_id"], "lost": "expired"}]
        assert [e["attempt_id"] for e in lost] == [lease["attempt_id"]]  # for the other ending only
