"""SIGKILL of the daemon: accepted tasks survive, and a restart recovers its own dead leases at once."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest

from .conftest import Daemon


def ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.mark.e2e
def test_sigkill_with_50_tasks_in_flight_recovers_on_restart_not_by_lease_time(
        make_daemon: Callable[..., Daemon]) -> None:
    lease_s = 30.0
    daemon = make_daemon({"lease": {"duration_s": lease_s, "renew_every_s": 10.0},
                          "retry": {"backoff_base_s": 0.2}, "pool": {"max_workers": 50}})
    daemon.start()
    ids = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "sleep", "payload": {"seconds": 5}}] * 50}).body["ids"]
    assert len(ids) == 50

    def all_running() -> bool:
        running = daemon.get("/v1/tasks?state=running&limit=1000").body["tasks"]
        return daemon.get("/v1/pool").body["busy"] == 50 and len(running) == 50

    daemon.wait_for("50 tasks running", all_running, timeout_s=10)
    daemon.kill()
    assert daemon.query("SELECT count(*) FROM tasks WHERE state = 'running'") == [(50,)]

    daemon.start()

    def all_completed() -> list[dict[str, Any]] | None:
        tasks = [daemon.task(i) for i in ids]
        return tasks if all(t["state"] == "completed" for t in tasks) else None

    # 60 s only so that it fails instead of hanging; how soon is bench/recovery.py's `restart` row. That the new
    # process expired its predecessor's leases when it started, not by their time, is the started_at check below.
    tasks: list[dict[str, Any]] = daemon.wait_for("every task to complete", all_completed, timeout_s=60, poll_s=0.2)

    for task in tasks:
        first, *rest = task["attempts"]
        assert [a["status"] for a in task["attempts"]] == ["expired", "succeeded"], task
        assert first["error"]["code"] == "lease_expired"
        assert task["attempt"] == 2 and task["state"] == "completed" and task["error"] is None
        assert ts(rest[0]["started_at"]) < ts(first["started_at"]) + lease_s, "second attempt waited for the lease"
    (succeeded_twice,), = daemon.query(
        "SELECT count(*) FROM (SELECT task_id FROM attempts WHERE status = 'succeeded' GROUP BY task_id "
        "HAVING count(*) > 1)")
    assert succeeded_twice == 0


@pytest.mark.e2e
def test_a_task_accepted_just_before_sigkill_survives_and_runs_after_restart(
        make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon({"retry": {"backoff_base_s": 0.2}})
    daemon.start()
    batch = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "sleep", "payload": {"seconds": 0.3}}] * 10})
    assert batch.status == 201
    last = daemon.post("/v1/tasks", {"type": "sleep", "payload": {"seconds": 0.3}})
    daemon.kill()  # at once after the 201: nothing had a chance to run or flush
    assert last.status == 201
    ids = [*batch.body["ids"], last.body["id"]]

    marks = ",".join("?" * len(ids))
    stored = dict(daemon.query(f"SELECT id, state FROM tasks WHERE id IN ({marks})", tuple(ids)))
    assert set(stored) == set(ids), "an acknowledged task is missing from the store after SIGKILL"
    assert stored[last.body["id"]] in ("pending", "leased", "running")

    daemon.start()
    for task_id in ids:
        task = daemon.wait_terminal(task_id)
        assert task["state"] == "completed", task
        statuses = [a["status"] for a in task["attempts"]]
        assert statuses.count("succeeded") == 1 and set(statuses) <= {"expired", "succeeded"}, statuses
    assert daemon.stop() == 0, daemon.log()
