"""The one JSON shape of each resource the API answers with, and the OpenAPI document made of the same models:
what each shape writes, that it is what the document says, and the document's own rules."""

from __future__ import annotations

import dataclasses
from typing import Any

import jsonschema_rs
import pytest

from tidepool.api import openapi
from tidepool.api.node import NodeOut, PoolOut
from tidepool.api.operations import PoolView
from tidepool.api.scans import ScanOut
from tidepool.api.schedules import ScheduleOut
from tidepool.errors import (
    Conflict,
    InvalidRequest,
    LeaseLost,
    QueueFull,
    ScheduleNotFound,
    SchemaMismatch,
    StoreUnavailable,
    TaskNotFound,
    TidepoolError,
)
from tidepool.execution.guards import GuardStats
from tidepool.execution.pool import PoolStats
from tidepool.execution.resources import ResourceStats
from tidepool.http.answers import Answer, TaskDetailOut, TaskOut
from tidepool.model import Artifact, Attempt, AttemptStatus, Phase, ResultBatch, State, Task, TaskError
from tidepool.scans import Job, JobState, Scan, ScanState
from tidepool.schedules import Schedule
from tidepool.store import Node

T0 = 1_700_000_000.25  # 2023-11-14T22:13:20.250000Z
ROUTES = {(method, op.route or path) for (method, path), op in openapi.OPERATIONS.items()}


def _task() -> Task:
    failed = Attempt("a1", "t1", 1, "n1", "w1", AttemptStatus.FAILED, T0 + 1, T0 + 2, TaskError("x", "boom", False),
                     1, "tail", T0 + 10)
    succeeded = Attempt("a2", "t1", 2, "n1", "w2", AttemptStatus.SUCCEEDED, T0 + 3, T0 + 4)
    results = (ResultBatch("p", 1, "k1", "s1", True, {"n": 1}, "a1"),
               ResultBatch("p", 2, "k2", "s2", True, [2.5], "a2"))
    return Task("t1", "noop", {"x": [1, 2.5, "é"]}, -5, State.COMPLETED, Phase.STOP, {"pct": 100}, 2, 3, 0, 5.0,
                ("gpu",), "key", "n1", None, T0, T0 + 4, T0, T0 + 4, (failed, succeeded), results, "acme")


TASK = {"id": "t1", "type": "noop", "organization": "acme", "payload": {"x": [1, 2.5, "é"]}, "priority": -5,
        "state": "completed", "phase": "stop", "progress": {"pct": 100}, "attempt": 2, "max_attempts": 3,
        "timeout_s": 5.0,
        "required_tags": ["gpu"], "idempotency_key": "key", "node_id": "n1", "error": None,
        "created_at": "2023-11-14T22:13:20.250000Z", "updated_at": "2023-11-14T22:13:24.250000Z",
        "available_at": "2023-11-14T22:13:20.250000Z", "finished_at": "2023-11-14T22:13:24.250000Z",
        "attempts": [{"id": "a1", "number": 1, "node_id": "n1", "worker_id": "w1", "status": "failed",
                      "started_at": "2023-11-14T22:13:21.250000Z", "finished_at": "2023-11-14T22:13:22.250000Z",
                      "error": {"code": "x", "message": "boom"}, "exit_status": 1, "stderr_tail": "tail",
                      "deadline_at": "2023-11-14T22:13:30.250000Z"},
                     {"id": "a2", "number": 2, "node_id": "n1", "worker_id": "w2", "status": "succeeded",
                      "started_at": "2023-11-14T22:13:23.250000Z", "finished_at": "2023-11-14T22:13:24.250000Z",
                      "error": None, "exit_status": None, "stderr_tail": None, "deadline_at": None}]}


def _document(**kwargs: Any) -> dict[str, Any]:
    return openapi.document(ROUTES, **kwargs)


def _conforms(shape: Answer) -> dict[str, Any]:
    """The shape's JSON, checked against its schema in the document."""
    schemas = _document()["components"]["schemas"]
    body = shape.to_json()
    schema = {**schemas[type(shape).__name__], "$defs": schemas}
    errors = [str(e) for e in jsonschema_rs.Draft202012Validator(_local_refs(schema)).iter_errors(body)]
    assert not errors, errors
    return body


def _local_refs(node: Any) -> Any:
    """The document's references (#/components/schemas/X) as references into the schema's own $defs."""
    if isinstance(node, dict):
        return {k: (v.replace("#/components/schemas/", "#/$defs/") if k == "$ref" else _local_refs(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_local_refs(v) for v in node]
    return node


def test_a_task_in_a_listing_has_every_field_but_its_results() -> None:
    assert _conforms(TaskOut.of(_task())) == TASK


def test_a_single_task_shows_as_final_only_the_results_of_an_attempt_that_did_not_fail() -> None:
    body = _conforms(TaskDetailOut.of(_task()))
    assert list(body) == [*TASK, "results", "inputs", "artifacts"] and {k: body[k] for k in TASK} == TASK
    assert body["results"] == [
        {"plugin": "p", "sequence": 1, "idempotency_key": "k1", "sha256": "s1", "final": False, "attempt_id": "a1",
         "payload": {"n": 1}},
        {"plugin": "p", "sequence": 2, "idempotency_key": "k2", "sha256": "s2", "final": True, "attempt_id": "a2",
         "payload": [2.5]}]


def test_a_single_task_shows_its_inputs_and_every_attempt_s_artifacts() -> None:
    sha = "ab" * 32
    task = dataclasses.replace(_task(), inputs={"sample": sha}, artifacts=(
        Artifact("report.xml", sha, 12, "application/xml", "a1", T0 + 2),
        Artifact("stdout", sha, 3, None, "a2", T0 + 4)))
    body = _conforms(TaskDetailOut.of(task))
    assert body["inputs"] == {"sample": sha}
    assert body["artifacts"] == [
        {"name": "report.xml", "sha256": sha, "size": 12, "content_type": "application/xml", "attempt_id": "a1",
         "created_at": "2023-11-14T22:13:22.250000Z"},
        {"name": "stdout", "sha256": sha, "size": 3, "content_type": None, "attempt_id": "a2",
         "created_at": "2023-11-14T22:13:24.250000Z"}]


def test_a_node_shows_its_liveness_at_the_time_asked() -> None:
    node = Node("n1", "i1", "host", 42, "1.0", T0, T0 + 10, 5.0, ("noop",), (("gpu", "x"),), 8)
    assert _conforms(NodeOut.of(node, now=T0 + 20)) == {
        "node_id": "n1", "instance_id": "i1", "hostname": "host", "pid": 42, "version": "1.0",
        "started_at": "2023-11-14T22:13:20.250000Z", "heartbeat_at": "2023-11-14T22:13:30.250000Z", "alive": True,
        "stopped_at": None, "task_types": ["noop"], "tags": [["gpu", "x"]], "max_workers": 8, "kind": "node"}
    assert NodeOut.of(node, now=T0 + 26).alive is False, "three heartbeats unheard"


def test_a_schedule_shows_its_definition_its_runs_and_its_last_task_state() -> None:
    schedule = Schedule("nightly", "noop", {"a": 1}, cron="0 3 * * *", next_tick_at=T0, next_run_at=T0 + 1,
                        last_task_id="t1")
    assert _conforms(ScheduleOut.of(schedule, last_task_state=State.FAILED)) == {
        "name": "nightly", "type": "noop", "payload": {"a": 1}, "cron": "0 3 * * *", "every_s": None,
        "timezone": "UTC", "jitter_s": 0.0, "catch_up": "last", "overlap": "allow", "priority": 0,
        "config_node": None, "paused": False, "next_run_at": "2023-11-14T22:13:21.250000Z", "last_run_at": None,
        "last_task_id": "t1", "last_task_state": "failed", "profile": None, "last_scan_id": None,
        "last_scan_state": None}


def test_a_profile_schedule_shows_its_last_scan_and_no_type() -> None:
    schedule = Schedule("weekly", profile="discover", every_s=60.0, last_task_id="s1")
    body = _conforms(ScheduleOut.of(schedule, last_scan_state=ScanState.SUCCEEDED))
    assert {k: body[k] for k in ("type", "profile", "last_task_id", "last_task_state", "last_scan_id",
                                 "last_scan_state")} == {
        "type": None, "profile": "discover", "last_task_id": None, "last_task_state": None, "last_scan_id": "s1",
        "last_scan_state": "succeeded"}


def test_the_pool_shows_its_sizes_queue_guards_and_resources() -> None:
    stats = PoolStats(2, 16, 30.0, 3, 1, 2, 1, True)
    guards = GuardStats(("disk",), 0, 100, None, 50)
    body = _conforms(PoolOut.of(PoolView(stats, node_id="n1", draining=False, queue={"pending": 4, "running": 1},
                                         guards=guards, resources={"gpu": ResourceStats(("cuda",), 2, 1)},
                                         pending_restart=["api.listen"]), gateway=True))
    assert body == {
        "node_id": "n1", "min_workers": 2, "max_workers": 16, "idle_timeout_s": 30.0, "workers": 3, "busy": 1,
        "baseline": 2, "demand": 1, "claiming": True, "draining": False, "queue": {"pending": 4, "running": 1},
        "guards": {"tripped": ["disk"], "min_free_memory_mb": 0, "min_free_disk_mb": 100, "free_memory_mb": None,
                   "free_disk_mb": 50},
        "resources": {"gpu": {"in_use": 1, "count": 2, "tags": ["cuda"]}}, "pending_restart": ["api.listen"],
        "gateway": True}


@pytest.mark.parametrize("error, status, code", [
    (InvalidRequest("type", "unknown"), 400, "invalid_request"), (TaskNotFound("t"), 404, "not_found"),
    (ScheduleNotFound("s"), 404, "not_found"), (Conflict("c"), 409, "conflict"), (QueueFull("q"), 429, "queue_full"),
    (StoreUnavailable("s"), 503, "store_unavailable")])
def test_an_error_the_api_answers_carries_its_status_and_code(error: TidepoolError, status: int, code: str) -> None:
    assert (error.http_status, error.code) == (status, code)


@pytest.mark.parametrize("error", [SchemaMismatch("newer"), LeaseLost("t", "a"), TidepoolError("x")])
def test_an_error_that_is_no_answer_has_no_status(error: TidepoolError) -> None:
    assert error.http_status is None


def test_the_document_declares_the_bearer_scheme_only_for_a_node_with_a_token() -> None:
    open_node, guarded = _document(), _document(bearer=True)
    assert "security" not in open_node and "securitySchemes" not in open_node["components"]
    assert guarded["security"] == [{"bearer": []}]
    assert guarded["paths"]["/healthz"]["get"]["security"] == []
    assert "401" in guarded["paths"]["/v1/pool"]["get"]["responses"]
    assert "401" not in open_node["paths"]["/v1/pool"]["get"]["responses"]


def test_the_document_holds_the_routes_it_is_given_and_refuses_an_undescribed_one() -> None:
    doc = openapi.document({("get", "/v1/pool"), ("post", "/v1/schedules/{name}/{action}"), ("head", "/v1/pool"),
                            ("get", "/metrics"), ("*", "/v1/tasks/batch")})
    assert doc["paths"].keys() == {"/v1/pool", "/v1/schedules/{name}/pause", "/v1/schedules/{name}/resume",
                                   "/v1/tasks/batch"}
    with pytest.raises(ValueError, match="GET /v1/secret"):
        openapi.document({("get", "/v1/secret")})


def test_the_states_of_the_document_are_the_models() -> None:
    schemas = _document()["components"]["schemas"]
    assert schemas["State"]["enum"] == [s.value for s in State]
    assert schemas["AttemptStatus"]["enum"] == [s.value for s in AttemptStatus]
    assert schemas["Phase"]["enum"] == [p.value for p in Phase]


def test_a_scan_shows_its_jobs_in_order_a_job_not_come_yet_without_a_task() -> None:
    sha = "cd" * 32
    jobs = (Job(0, "tcp_connect", JobState.FAILED, "t1", 3, TaskError("resolve_failed", "no such host", False), 1,
                {"out.txt": sha}),
            Job(1, "http_probe", JobState.SKIPPED))
    scan = Scan("s1", "discover", ScanState.FAILED, "default", {"target": "x"}, {"open_ports": [80]}, 0, False, None,
                jobs, T0, T0 + 1, T0 + 1, inputs={"targets": sha})
    assert _conforms(ScanOut.of(scan)) == {
        "id": "s1", "profile": "discover", "state": "failed", "organization": "default", "payload": {"target": "x"},
        "inputs": {"targets": sha}, "scope": {"open_ports": [80]},
        "jobs": [{"index": 0, "step": "tcp_connect", "state": "failed", "task_id": "t1", "attempts": 3,
                  "error": {"code": "resolve_failed", "message": "no such host"}, "artifacts": {"out.txt": sha}},
                 {"index": 1, "step": "http_probe", "state": "skipped", "task_id": None, "attempts": 0,
                  "error": None, "artifacts": {}}],
        "created_at": "2023-11-14T22:13:20.250000Z", "updated_at": "2023-11-14T22:13:21.250000Z",
        "finished_at": "2023-11-14T22:13:21.250000Z"}


def test_the_scan_listing_documents_exactly_the_parameters_its_route_takes() -> None:
    from tidepool.api import scans

    assert [p["name"] for p in openapi.SCAN_LISTING] == list(scans.LIST_PARAMETERS)
