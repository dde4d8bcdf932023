"""The HTTP API of a live daemon: cancel answers (202 with the state, 409 once terminal) and bad requests
that change nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from .conftest import UNKNOWN_ID, Daemon


@pytest.mark.e2e
def test_cancel_of_a_running_task_stops_it_and_ends_it_cancelled(daemon: Daemon) -> None:
    task = daemon.submit("sleep", {"seconds": 60})
    daemon.wait_for("the task to run", lambda: daemon.task(task["id"])["phase"] == "run", timeout_s=10)

    first = daemon.post(f"/v1/tasks/{task['id']}/cancel")
    assert (first.status, first.body) == (202, {"state": "cancelling"})
    ended = daemon.wait_terminal(task["id"], timeout_s=10)
    assert ended["state"] == "cancelled"
    assert [a["status"] for a in ended["attempts"]] == ["cancelled"]
    assert ended["finished_at"] is not None and ended["phase"] is None
    assert daemon.get("/v1/pool").body["busy"] == 0, "the worker must be free again"

    again = daemon.post(f"/v1/tasks/{task['id']}/cancel")
    assert (again.status, again.body) == (202, {"state": "cancelled"}), "a repeated cancel is a no-op"


@pytest.mark.e2e
def test_cancel_of_a_pending_task_is_immediate(daemon: Daemon) -> None:
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    task = daemon.submit("noop", available_at=later)
    r = daemon.post(f"/v1/tasks/{task['id']}/cancel")
    assert (r.status, r.body) == (202, {"state": "cancelled"})
    ended = daemon.task(task["id"])
    assert ended["state"] == "cancelled" and ended["attempts"] == []


@pytest.mark.e2e
def test_cancel_of_a_completed_task_is_409_and_of_an_unknown_one_404(daemon: Daemon) -> None:
    task = daemon.submit("noop")
    assert daemon.wait_terminal(task["id"])["state"] == "completed"

    r = daemon.post(f"/v1/tasks/{task['id']}/cancel")
    assert r.status == 409 and r.error["code"] == "conflict"
    assert daemon.task(task["id"])["state"] == "completed", "a refused cancel changes nothing"

    r = daemon.post(f"/v1/tasks/{UNKNOWN_ID}/cancel")
    assert r.status == 404 and r.error["code"] == "not_found"
    assert daemon.get(f"/v1/tasks/{UNKNOWN_ID}").status == 404


@pytest.mark.e2e
def test_bad_requests_are_refused_with_json_errors_and_change_nothing(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon({"api": {"max_body_kb": 1}})
    daemon.start()

    malformed = daemon.request("POST", "/v1/tasks", data=b'{"type": "noop",')
    assert malformed.status == 400 and malformed.error["code"] == "invalid_json", malformed

    wrong_type = daemon.request("POST", "/v1/tasks", data=json.dumps({"type": "noop"}).encode(),
                                content_type="text/plain")
    assert wrong_type.status == 415 and wrong_type.error["message"], wrong_type

    no_type = daemon.request("POST", "/v1/tasks", data=b'{"type": "noop"}', content_type=None)
    assert no_type.status == 415, no_type

    unknown = daemon.post("/v1/tasks", {"type": "no-such-type"})
    assert unknown.status == 400 and "type" in unknown.error["message"], unknown

    extra = daemon.post("/v1/tasks", {"type": "noop", "colour": "red"})
    assert extra.status == 400 and "colour" in extra.error["message"], extra

    too_big = daemon.post("/v1/tasks", {"type": "noop", "payload": {"blob": "x" * 2048}})
    assert too_big.status == 413 and too_big.error["code"] == "body_too_large", too_big

    batch = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "noop"}, {"type": "no-such-type"}]})
    assert batch.status == 400 and "tasks.1.type" in batch.error["message"], batch

    listed = daemon.get("/v1/tasks")
    assert (listed.status, listed.body) == (200, {"tasks": [], "next_cursor": None})
    assert not any(daemon.get("/v1/pool").body["queue"].values())
    assert daemon.query("SELECT count(*) FROM tasks") == [(0,)]


@pytest.mark.e2e
def test_a_types_max_attempts_applies_unless_the_request_gives_its_own(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon({"retry": {"max_attempts": 4, "backoff_base_s": 0.0, "jitter": 0.0},
                          "plugins.fail": {"command": ["false"]},
                          "types.failer": {"plugins": ["fail"], "max_attempts": 1}})
    daemon.start()

    task = daemon.submit("failer")
    assert task["max_attempts"] == 1, "the type's max_attempts, not retry.max_attempts"
    ended = daemon.wait_terminal(task["id"])
    assert ended["state"] == "failed" and len(ended["attempts"]) == 1, ended

    own = daemon.submit("failer", max_attempts=2)
    assert own["max_attempts"] == 2, "the request's own max_attempts wins over the type's"
    assert len(daemon.wait_terminal(own["id"])["attempts"]) == 2
    assert daemon.submit("noop")["max_attempts"] == 4, "a type without one gets retry.max_attempts"

    r = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "failer"}, {"type": "failer", "max_attempts": 3},
                                                  {"type": "noop"}]})
    assert r.status == 201, r
    assert [daemon.task(i)["max_attempts"] for i in r.body["ids"]] == [1, 3, 4]


@pytest.mark.e2e
def test_a_tasks_organization_is_submitted_shown_and_listed_by(daemon: Daemon) -> None:
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()  # kept queued: the listing is of known states
    acme = daemon.submit("noop", organization="acme", available_at=later)
    assert acme["organization"] == "acme"
    assert daemon.submit("noop", available_at=later)["organization"] == "default"
    batch = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "noop", "organization": "acme", "available_at": later},
                                                      {"type": "noop", "organization": "globex.eu_1"}]})
    assert batch.status == 201, batch
    acme_batch, globex = batch.body["ids"]
    assert daemon.task(globex)["organization"] == "globex.eu_1"

    listed = daemon.get("/v1/tasks?organization=acme")
    assert listed.status == 200 and [t["id"] for t in listed.body["tasks"]] == [acme_batch, acme["id"]], listed
    assert all(t["organization"] == "acme" for t in listed.body["tasks"])
    assert daemon.get("/v1/tasks?organization=initech").body == {"tasks": [], "next_cursor": None}
    # a node's own workers serve every organization
    assert daemon.wait_terminal(globex)["state"] == "completed"

    queued = daemon.query("SELECT count(*) FROM tasks")
    for bad in ("", "a b", "x" * 65, "ümlaut"):
        one = daemon.post("/v1/tasks", {"type": "noop", "organization": bad})
        assert one.status == 400 and "organization" in one.error["message"], one
        many = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "noop"}, {"type": "noop", "organization": bad}]})
        assert many.status == 400 and "tasks.1.organization" in many.error["message"], many
    filtered = daemon.get("/v1/tasks?organization=a%20b")
    assert filtered.status == 400 and filtered.error["message"].startswith("organization:"), filtered
    assert daemon.query("SELECT count(*) FROM tasks") == queued, "a refused submit queues nothing"

    metrics = daemon.request("GET", "/metrics").body
    assert 'tidepool_tasks_by_organization{organization="acme"} 2.0' in metrics.splitlines(), metrics
