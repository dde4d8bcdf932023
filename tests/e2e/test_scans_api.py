"""Scans through the HTTP API of a live daemon on SQLite: submit, read, list, idempotency, bad input, cancel,
the retry of a job, their events and metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from ..process_trees import gone, pids
from .api_helpers import EventStream, Sse
from .conftest import UNKNOWN_ID, Daemon
from .scan_helpers import profiles_config, scan, states, submit_scan, wait_ended

pytestmark = pytest.mark.e2e


@pytest.fixture
def daemon(make_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    d = make_daemon(profiles_config(tmp_path))
    d.start()
    return d


def test_a_scan_runs_its_steps_in_order_each_its_own_task_and_reads_back_as_it_was_answered(daemon: Daemon) -> None:
    created = submit_scan(daemon, "three", {"target": "example.org"}, priority=5)
    assert created["state"] == "pending" and created["profile"] == "three"
    assert [(j["index"], j["step"]) for j in created["jobs"]] == [(0, "noop"), (1, "noop"), (2, "noop")]
    assert created["jobs"][0]["task_id"] is not None, "the 201 carries job 0's task"
    assert [j["task_id"] for j in created["jobs"][1:]] == [None, None] and states(created)[1:] == ["waiting"] * 2

    ended = wait_ended(daemon, created["id"])
    assert ended["state"] == "succeeded" and states(ended) == ["success"] * 3 and ended["finished_at"]
    tasks = [daemon.task(j["task_id"]) for j in ended["jobs"]]
    assert len({t["id"] for t in tasks}) == 3
    assert all(t["type"] == "noop" and t["priority"] == 5 and t["state"] == "completed" for t in tasks)
    assert all(t["payload"] == {"target": "example.org"} for t in tasks)
    assert tasks[0]["created_at"] < tasks[1]["created_at"] < tasks[2]["created_at"], "one step after the other"
    assert [j["attempts"] for j in ended["jobs"]] == [1, 1, 1]


def test_scans_list_newest_first_by_state_and_profile_page_by_page(daemon: Daemon) -> None:
    ids = [submit_scan(daemon, "three")["id"] for _ in range(3)]
    for scan_id in ids:
        wait_ended(daemon, scan_id)
    gated = submit_scan(daemon, "gated")["id"]
    assert wait_ended(daemon, gated)["state"] == "failed"

    listed = daemon.get("/v1/scans").body
    assert [s["id"] for s in listed["scans"]] == [gated, *ids[::-1]] and listed["next_cursor"] is None
    assert [s["id"] for s in daemon.get("/v1/scans?state=failed").body["scans"]] == [gated]
    assert [s["id"] for s in daemon.get("/v1/scans?profile=three&state=succeeded").body["scans"]] == ids[::-1]
    first = daemon.get("/v1/scans?limit=2").body
    assert [s["id"] for s in first["scans"]] == [gated, ids[2]] and first["next_cursor"]
    rest = daemon.get(f"/v1/scans?limit=2&cursor={first['next_cursor']}").body
    assert [s["id"] for s in rest["scans"]] == [ids[1], ids[0]]


def test_a_resubmit_with_the_same_key_is_that_scan_and_with_another_body_a_conflict(daemon: Daemon) -> None:
    first = daemon.post("/v1/scans", {"profile": "three", "payload": {"a": 1}, "idempotency_key": "k1"})
    again = daemon.post("/v1/scans", {"profile": "three", "payload": {"a": 1}, "idempotency_key": "k1"})
    other = daemon.post("/v1/scans", {"profile": "three", "payload": {"a": 2}, "idempotency_key": "k1"})
    assert (first.status, again.status, other.status) == (201, 200, 409)
    assert again.body["id"] == first.body["id"] and other.error["code"] == "conflict"
    assert len(daemon.get("/v1/scans").body["scans"]) == 1


@pytest.mark.parametrize(("body", "named"), [
    ({"profile": "nope"}, "profile: unknown profile 'nope'"),
    ({"profile": "three", "payload": {"blob": "x" * 70_000}}, "payload: "),
    ({"profile": "three", "priority": "5"}, "priority: "),
    ({"profile": "three", "payload": [1]}, "payload: "),
    ({"profile": "three", "steps": ["noop"]}, "steps: not a field of this request"),
    ({"profile": "three", "organization": ""}, "organization: "),
    ({}, "profile: "),
    ({"profile": "far"}, "profile: step 1 (far) of profile 'far' needs tags no resource of this fleet has"),
])
def test_bad_input_is_a_400_naming_the_field_and_creates_nothing(daemon: Daemon, body: dict[str, object],
                                                                 named: str) -> None:
    r = daemon.post("/v1/scans", body)
    assert r.status == 400 and r.error["code"] == "invalid_request", r
    assert r.error["message"].startswith(named), r.error
    assert daemon.get("/v1/scans").body["scans"] == [] and daemon.get("/v1/tasks").body["tasks"] == []


def test_reads_of_what_is_not_there_are_404_and_bad_filters_400(daemon: Daemon) -> None:
    assert daemon.get(f"/v1/scans/{UNKNOWN_ID}").error["code"] == "scan_not_found"
    assert daemon.post(f"/v1/scans/{UNKNOWN_ID}/cancel").status == 404
    assert daemon.post(f"/v1/scans/{UNKNOWN_ID}/jobs/0/retry").status == 404
    for query, named in (("state=done", "state: "), ("limit=0", "limit: "), ("cursor=x", "cursor: "),
                         ("profile=", "profile: "), ("type=noop", "type: not a parameter")):
        r = daemon.get(f"/v1/scans?{query}")
        assert r.status == 400 and r.error["message"].startswith(named), (query, r)


def test_cancel_during_a_command_step_kills_its_tree_and_skips_the_steps_after_it(daemon: Daemon,
                                                                                   tmp_path: Path) -> None:
    pidfile = tmp_path / "tree.pids"
    created = submit_scan(daemon, "tree", {"pidfile": str(pidfile)})
    tree = daemon.wait_for("the whole tree to start", lambda: len(p := pids(pidfile)) == 4 and p)

    r = daemon.post(f"/v1/scans/{created['id']}/cancel")
    assert (r.status, r.body) == (202, {"state": "running"}), "running until its step's task has ended"
    ended = wait_ended(daemon, created["id"])
    assert ended["state"] == "cancelled" and states(ended) == ["cancelled", "skipped", "skipped"]
    assert daemon.task(ended["jobs"][0]["task_id"])["state"] == "cancelled"
    daemon.wait_for("every process of the tree to be gone", lambda: all(gone(pid) for pid in tree.values()),
                    timeout_s=10)
    assert len(daemon.get("/v1/tasks").body["tasks"]) == 1, "no task for the skipped steps"
    again = daemon.post(f"/v1/scans/{created['id']}/cancel")
    assert (again.status, again.body) == (202, {"state": "cancelled"}), "a repeated cancel changes nothing"


def test_a_retried_job_resumes_the_scan_from_it_and_only_a_failed_job_of_an_ended_scan_is_retried(
        daemon: Daemon, tmp_path: Path) -> None:
    created = submit_scan(daemon, "gated")
    failed = wait_ended(daemon, created["id"])
    assert failed["state"] == "failed" and states(failed) == ["success", "failed", "skipped"]
    assert failed["jobs"][1]["error"]["code"] == "exit_status"
    first_of_job0, first_of_job1 = failed["jobs"][0]["task_id"], failed["jobs"][1]["task_id"]
    gate = daemon.task(first_of_job1)  # each step's task has its type's defaults, resolved at submit
    assert (gate["type"], gate["max_attempts"], gate["timeout_s"], gate["required_tags"]) == ("gate", 1, 30.0, ["box"])
    assert daemon.task(first_of_job0)["max_attempts"] == 3, "a type without its own: retry.max_attempts"
    assert daemon.post(f"/v1/scans/{created['id']}/jobs/0/retry").status == 409, "job 0 succeeded"
    r = daemon.post(f"/v1/scans/{created['id']}/jobs/7/retry")
    assert r.status == 400 and r.error["message"].startswith("index: ")
    assert daemon.post(f"/v1/scans/{created['id']}/jobs/x/retry").status == 400

    (tmp_path / "flag").touch()  # what the step needed is there now
    r = daemon.post(f"/v1/scans/{created['id']}/jobs/1/retry")
    assert r.status == 202 and r.body["state"] == "running" and states(r.body)[1:] == ["queued", "waiting"]
    ended = wait_ended(daemon, created["id"])
    assert ended["state"] == "succeeded" and states(ended) == ["success"] * 3
    assert ended["jobs"][0]["task_id"] == first_of_job0, "the job before it did not run again"
    assert ended["jobs"][1]["task_id"] != first_of_job1, "the retried job has a task of its own"
    assert daemon.task(first_of_job1)["state"] == "failed", "its failed task is kept as it was"
    assert daemon.post(f"/v1/tasks/{first_of_job1}/retry").status == 409, "a step's task is retried as its job"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_a_scan_s_events_tell_its_creation_each_step_and_its_end_and_the_metrics_count_them(
        daemon: Daemon, session: aiohttp.ClientSession) -> None:
    stream = await EventStream.open(session, daemon, type="scan.*")
    async with session.post(f"{daemon.url}/v1/scans", json={"profile": "gated"}) as r:
        scan_id = (await r.json())["id"]
    events = await stream.until(lambda e: e.event == "scan.finished")
    stream.close()
    mine = [e for e in events if e.data.get("scan_id") == scan_id]
    told = [(e.event, e.data.get("index"), e.data.get("state")) for e in mine]
    assert told == [("scan.created", None, None), ("scan.step", 0, "queued"), ("scan.step", 0, "success"),
                    ("scan.step", 1, "queued"), ("scan.step", 1, "failed"), ("scan.finished", None, "failed")]
    assert all(e.data["profile"] == "gated" for e in mine)
    first_task = scan(daemon, scan_id)["jobs"][0]["task_id"]
    by_task = await EventStream.open(session, daemon, task_id=first_task, last_id=0)
    assert [e.event for e in await by_task.until(_is("task.finished"))].count("scan.step") == 1
    by_task.close()
    async with session.get(f"{daemon.url}/metrics") as r:
        text = await r.text()
    assert 'tidepool_scans_created_total{profile="gated"} 1.0' in text
    assert 'tidepool_scans_finished_total{profile="gated",state="failed"} 1.0' in text
    assert 'tidepool_scan_steps_finished_total{profile="gated",state="success"} 1.0' in text
    assert 'tidepool_scans_finished_total{profile="three",state="succeeded"} 0.0' in text, "known before use"


def _is(name: str) -> Callable[[Sse], bool]:
    return lambda e: e.event == name
