"""What a remote worker writes, a NUL among it (what a scan target prints), is stored with U+FFFD for each,
and its ending lands with its real outcome, on the gateway's SQLite and PostgreSQL stores alike. (A JSON body
is UTF-8 with no lone surrogate escape, or it is refused 400 invalid_json: tidepool's own workers make their
text storable before they send it.)"""

from __future__ import annotations

from typing import Any

import pytest

from tidepool.model import sha256_of

from .conftest import AUTO, MakeNode, lease_of

pytestmark = pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])

R = "\ufffd"
DIRTY = "a\x00b\x00\x00c"  # sent as the JSON escape \u0000, which PostgreSQL refuses in jsonb and text
CLEAN = f"a{R}b{R}{R}c"


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
