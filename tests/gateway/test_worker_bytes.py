"""What a remote worker writes, a NUL among it (what a scan target prints), is stored with U+FFFD for each,
and its ending lands with its real outcome, on the gateway's SQLite and PostgreSQL stores alike. (A JSON body
is UTF-8 with no lone surrogate escape, or it is refused 400 invalid_json: tidepool's own workers make their
text storable before they send it.)"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from tidepool.errors import ValueRefused
from tidepool.execution.leases import Held
from tidepool.execution.outcomes import OutcomeWriter, Posted
from tidepool.lifecycle import RetryPolicy
from tidepool.model import AttemptStatus, ClaimFilter, Outcome, ResultBatch, State, TaskError, Worker, sha256_of
from tidepool.store import Ending
from tidepool.store.remote import RemoteStore

from .conftest import AUTO, MakeNode, lease_of

pytestmark = pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])

R = "\ufffd"
DIRTY = "a\x00b\x00\x00c"  # sent as the JSON escape \u0000, which PostgreSQL refuses in jsonb and text
CLEAN = f"a{R}b{R}{R}c"
WORKER = Worker("w1", "i1", "w1/1")
POLICY = RetryPolicy(base_s=0.0, jitter=0.0)


async def test_a_remote_workers_dirty_result_progress_and_success_are_stored_and_the_task_completes(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        note = {**lease_of(lease), "phase": "run", "progress": {"fraction": 0.5, "message": DIRTY}}
        assert (await w1.post("/w1/phase", {"notes": [note]})).body == {"lost": []}
        payload: dict[str, Any] = {"text": DIRTY, DIRTY: [DIRTY, {"k\x00": 1}]}
        result = {**lease_of(lease), "plugin": "command", "sequence": 0, "idempotency_key": "out",
                  "sha256": sha256_of(payload), "final": True, "payload": payload}
        stored = await w1.post("/w1/results", result)
        assert stored.status == 201, stored
        again = await w1.post("/w1/results", result)  # its answer lost: sent again, the same batch
        assert again.status == 200, again
        ending = {**lease_of(lease), "status": "succeeded", "stderr_tail": DIRTY}
        finished = await w1.post("/w1/finish", {"endings": [ending]})
        assert finished.body == {"endings": [{"attempt_id": lease["attempt_id"], "state": "completed"}]}, finished
        task = await node.task(task_id)
        assert task["state"] == "completed"
        assert [r["payload"] for r in task["results"]] == [{"text": CLEAN, CLEAN: [CLEAN, {f"k{R}": 1}]}]
        assert task["attempts"][0]["stderr_tail"] == CLEAN
        assert task["progress"] == {"fraction": 0.5, "message": CLEAN}


async def test_a_remote_workers_failure_with_dirty_text_fails_with_its_exit_status(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit(max_attempts=1)
        w1 = node.remote("w1")
        lease = await w1.leased()
        ending = {**lease_of(lease), "status": "failed", "exit_status": 3, "stderr_tail": DIRTY,
                  "error": {"code": "exit_status", "message": f"nmap exited with status 3: {DIRTY}"},
                  "retryable": False}
        finished = await w1.post("/w1/finish", {"endings": [ending]})
        assert finished.body == {"endings": [{"attempt_id": lease["attempt_id"], "state": "failed"}]}, finished
        task = await node.task(task_id)
        assert task["state"] == "failed"
        assert task["error"] == {"code": "exit_status", "message": f"nmap exited with status 3: {CLEAN}"}
        (attempt,) = task["attempts"]
        assert (attempt["exit_status"], attempt["stderr_tail"]) == (3, CLEAN)


async def remote_store(node: Any) -> RemoteStore:
    issued = node.lab.workers["w1"]
    store = RemoteStore(node.w1, cert_file=str(issued.cert), key_file=str(issued.key), ca_file=str(node.lab.ca_file))
    await store.open()
    return store


async def test_tidepools_remote_worker_sends_lone_surrogates_as_u_fffd_and_the_result_is_stored(
        make_node: MakeNode) -> None:
    """A JSON body holds no lone surrogate: the worker's port makes its text storable before it is sent."""
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit(max_attempts=1)
        store = await remote_store(node)
        try:
            (claimed,) = await store.claim(WORKER, ClaimFilter(types=("noop",)), limit=1, now=time.time(), lease_s=30.0)
            payload = {"raw": "\udcff\udcfeopen\x00", "k\ud800": ["x\udfff"]}
            batch = ResultBatch("command", 0, f"{task_id}:out", sha256_of(payload), True, payload)
            ack = await store.record_result(claimed.lease, batch, now=time.time())
            stored = {"raw": f"{R}{R}open{R}", f"k{R}": [f"x{R}"]}
            assert (ack.payload, ack.sha256) == (stored, sha256_of(stored))
            ended = Outcome(AttemptStatus.FAILED, TaskError("exit_status", "said \udcff", False), 1, "tail \udcff\x00")
            assert await store.finish_many([Ending(claimed.lease, ended, time.time())], policy=POLICY) == [State.FAILED]
        finally:
            await store.close()
        task = await node.task(task_id)
        assert [r["payload"] for r in task["results"]] == [stored]
        assert task["error"] == {"code": "exit_status", "message": f"said {R}"}
        assert task["attempts"][0]["stderr_tail"] == f"tail {R}{R}"


async def test_an_ending_the_gateway_refuses_is_value_refused_and_its_lease_stays_for_the_failure_written_instead(
        make_node: MakeNode) -> None:
    """A value the gateway will never take (an exit status past any a command has) is not retried as though the
    gateway were away until the lease ran out: the outcome writer records the failure instead, at once."""
    async with make_node(gateway=AUTO) as node:
        task_id = await node.submit(max_attempts=1)
        store = await remote_store(node)
        try:
            (claimed,) = await store.claim(WORKER, ClaimFilter(types=("noop",)), limit=1, now=time.time(), lease_s=30.0)
            ended = Outcome(AttemptStatus.SUCCEEDED, exit_status=300)
            with anyio.fail_after(2.0):  # the gateway's restarts are waited for for a lease; this is no restart
                (refused,) = await store.finish_many([Ending(claimed.lease, ended, time.time())], policy=POLICY)
            assert isinstance(refused, ValueRefused), refused
            posted = Posted(claimed.task, Held(claimed.lease, anyio.CancelScope(), time.monotonic() + 30), ended,
                            WORKER.worker_id, time.time())
            answers: list[object] = []
            writer = OutcomeWriter(store, policy=lambda: POLICY, report=lambda p, a: answers.append(a))
            async with anyio.create_task_group() as tg:
                await tg.start(writer.run)
                writer.post(posted)
                with anyio.fail_after(5.0):
                    await writer.flushed()
                tg.cancel_scope.cancel()
            assert answers == [State.FAILED]
        finally:
            await store.close()
        task = await node.task(task_id)
        assert (task["state"], task["error"]["code"]) == ("failed", "value_refused")
