"""GET /v1/openapi.json: a valid OpenAPI 3.1 document of every route, saying what the node does (a bearer scheme
only when it has a token), and schemathesis against the live daemon with every check, with and without a token
(property-based requests): no 5xx, every response matches the document, and the server refuses what the
document forbids and accepts what it allows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest

from .api_helpers import bearer, call
from .conftest import TOKEN, Daemon

SCHEMATHESIS_EXAMPLES = 10  # per operation and phase: each run takes 20-70 s (every phase; two cores, loaded or not)
SCHEMATHESIS_DEADLINE_S = 300  # a hung run fails the test rather than the suite
# Statuses the API answers on purpose beyond what a JSON schema can say: a type or tag set the node does not
# serve, pool sizes that contradict each other, a cron that never fires (400), a body over api.max_body_kb
# before it is read (413). An event stream never ends: a request to it stops reading after its first second.
SCHEMATHESIS_CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "404", "409", "429"]

[checks.negative_data_rejection]
expected-statuses = ["400", "401", "404", "405", "409", "413", "415", "429"]

[[operations]]
include-path = "/v1/events"
request-timeout = 1.0
"""
DOCUMENTED_ROUTES = {
    ("post", "/v1/tasks"), ("get", "/v1/tasks"), ("post", "/v1/tasks/batch"), ("get", "/v1/tasks/{id}"),
    ("post", "/v1/tasks/{id}/cancel"), ("post", "/v1/tasks/{id}/retry"), ("get", "/v1/pool"),
    ("patch", "/v1/pool"), ("get", "/v1/events"), ("get", "/v1/nodes"), ("get", "/v1/schedules"),
    ("post", "/v1/schedules"),
    ("delete", "/v1/schedules/{name}"), ("post", "/v1/schedules/{name}/pause"),
    ("post", "/v1/schedules/{name}/resume"), ("get", "/healthz"), ("get", "/readyz"),
    ("post", "/v1/blobs"), ("get", "/v1/blobs/{sha256}"), ("head", "/v1/blobs/{sha256}"),
    ("get", "/v1/tasks/{id}/artifacts"), ("get", "/v1/tasks/{id}/artifacts/{name}"),
}


@pytest.fixture
def token_daemon(make_token_daemon: Callable[..., Daemon]) -> Daemon:
    return make_token_daemon({"log": {"level": "warning"}, "pool": {"max_workers": 8}})


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        return {node["$ref"]} if isinstance(node.get("$ref"), str) else set().union(*map(_refs, node.values()))
    if isinstance(node, list):
        return set().union(*map(_refs, node)) if node else set()
    return set()


def _valid_openapi_3_1(doc: dict[str, Any], unavailable: Callable[[str], NoReturn]) -> None:
    assert doc["openapi"] == "3.1.0" and doc["info"]["title"] == "tidepool"
    try:  # the official OpenAPI 3.1 schema, as schemathesis ships it, checked with its JSON Schema engine
        import jsonschema_rs
        from schemathesis.specs.openapi.definitions import OPENAPI_31
    except ImportError as exc:
        unavailable(f"schemathesis is not installed (pip install -e '.[dev]'): {exc}")
    errors = [str(e) for e in jsonschema_rs.Draft202012Validator(OPENAPI_31).iter_errors(doc)]
    assert not errors, errors


@pytest.mark.e2e
def test_the_document_is_valid_openapi_3_1_and_covers_every_route(
        daemon: Daemon, unavailable: Callable[[str], NoReturn]) -> None:
    r = daemon.get("/v1/openapi.json")
    assert r.status == 200
    doc = r.body
    _valid_openapi_3_1(doc, unavailable)

    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    missing = DOCUMENTED_ROUTES - documented
    assert not missing, f"routes of the HTTP API missing from the document: {missing}"
    schemas = doc["components"]["schemas"]
    for ref in _refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref

    submit = schemas["SubmitTask"]
    assert submit["additionalProperties"] is False and submit["required"] == ["type"]
    assert set(submit["properties"]["type"]["enum"]) >= {"noop", "sleep", "scan"}, "the node's task types"
    assert schemas["State"]["enum"] == ["pending", "leased", "running", "retry_wait", "cancelling", "completed",
                                        "failed", "timed_out", "cancelled"]
    listing = {p["name"]: p["schema"] for p in doc["paths"]["/v1/tasks"]["get"]["parameters"]}
    assert listing["state"]["enum"] == schemas["State"]["enum"]
    # without a token nothing is asked for: no scheme, no 401, no Authorization header anywhere
    assert "security" not in doc and "securitySchemes" not in doc["components"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "401" not in op["responses"] and "security" not in op, (method, path)
            assert all(p["name"] != "Authorization" for p in op.get("parameters", ())), (method, path)


@pytest.mark.e2e
def test_with_a_token_the_document_declares_the_bearer_scheme_on_every_route_but_the_probes(
        token_daemon: Daemon, unavailable: Callable[[str], NoReturn]) -> None:
    doc = call(token_daemon, "GET", "/v1/openapi.json", headers=bearer(TOKEN)).body
    _valid_openapi_3_1(doc, unavailable)
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert doc["security"] == [{"bearer": []}]
    assert doc["paths"]["/healthz"]["get"]["security"] == [] and doc["paths"]["/readyz"]["get"]["security"] == []
    for (method, path) in DOCUMENTED_ROUTES:
        if path.startswith("/v1/"):
            assert "401" in doc["paths"][path][method]["responses"], (method, path)


def _keys(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set(node).union(*map(_keys, node.values()))
    return set().union(*map(_keys, node)) if isinstance(node, list) and node else set()


@pytest.mark.e2e
def test_the_document_states_the_bounds_the_server_enforces(daemon: Daemon) -> None:
    """Each value the document allows, the server takes; each it says is out of bounds, the server refuses."""
    import jsonschema_rs

    doc = daemon.get("/v1/openapi.json").body
    assert not _keys(doc) & {"ge", "le", "gt", "lt"}, "a bound in pydantic's words, which no client reads"
    schemas = doc["components"]["schemas"]

    def validator(model: str) -> Any:
        return jsonschema_rs.Draft202012Validator({**schemas[model], "$defs": schemas})

    cases = [
        ("PoolPatch", "PATCH", "/v1/pool", {"max_workers": 0}), ("PoolPatch", "PATCH", "/v1/pool", {"min_workers": 0}),
        ("SubmitTask", "POST", "/v1/tasks", {"type": "noop", "required_tags": [""]}),
        ("SubmitTask", "POST", "/v1/tasks", {"type": "noop", "required_tags": [" gpu"]}),
        ("SubmitTask", "POST", "/v1/tasks", {"type": "noop", "required_tags": ["a,b"]}),
        ("SubmitTask", "POST", "/v1/tasks", {"type": "noop", "max_attempts": 0}),
        ("SubmitTask", "POST", "/v1/tasks", {"type": "noop", "available_at": "0999-01-01T00:00:00Z"}),
        ("ScheduleIn", "POST", "/v1/schedules", {"name": "n", "type": "noop", "cron": ""}),
        ("ScheduleIn", "POST", "/v1/schedules", {"name": "n", "type": "noop", "cron": "* * *"}),
    ]
    for model, method, route, body in cases:
        assert not validator(model).is_valid(body), body
        answer = call(daemon, method, route, body)
        assert answer.status == 400, (body, answer)
    assert validator("SubmitTask").is_valid({"type": "noop", "required_tags": ["gpu"], "max_attempts": 3.0,
                                              "available_at": "2030-01-01T00:00:00Z"})
    assert validator("ScheduleIn").is_valid({"name": "n", "type": "noop", "cron": "@daily"})

    events = next(p for p in doc["paths"]["/v1/events"]["get"]["parameters"] if p["name"] == "type")
    assert {"task.finished", "task.*", "scan.*", "*"} <= set(events["schema"]["items"]["enum"])
    assert "|" not in events["schema"]["items"]["enum"] and daemon.get("/v1/events?type=%7C").status == 400
    index = next(p for p in doc["paths"]["/v1/scans/{id}/jobs/{index}/retry"]["post"]["parameters"]
                 if p["name"] == "index")
    assert index["schema"]["maximum"] == 999_999
    assert call(daemon, "POST", "/v1/scans/x/jobs/1000000/retry").status == 400


@pytest.mark.e2e
def test_the_document_allows_a_schedule_exactly_one_timing_and_the_server_agrees(daemon: Daemon) -> None:
    import jsonschema_rs

    doc = daemon.get("/v1/openapi.json").body
    validator = jsonschema_rs.Draft202012Validator({**doc["components"]["schemas"]["ScheduleIn"],
                                                    "$defs": doc["components"]["schemas"]})
    base = {"name": "tick", "type": "noop"}
    for timing, allowed in (({"cron": "* * * * *"}, True), ({"every_s": 60}, True),
                            ({"cron": "* * * * *", "every_s": None}, True), ({"cron": None, "every_s": 60}, True),
                            ({"cron": "* * * * *", "every_s": 60}, False), ({}, False),
                            ({"cron": None, "every_s": None}, False)):
        body = {**base, **timing}
        assert validator.is_valid(body) is allowed, body
        answer = daemon.post("/v1/schedules", body)
        assert answer.status == (201 if allowed else 400), (body, answer)


@pytest.mark.e2e
@pytest.mark.parametrize("route, body", [("/v1/tasks", {"type": "noop", "priority": -1784.0, "max_attempts": 2.0}),
                                         ("/v1/schedules", {"name": "n", "type": "noop", "every_s": 60,
                                                            "priority": 3.0})])
def test_an_integral_number_is_an_integer_as_the_document_says(daemon: Daemon, route: str,
                                                                 body: dict[str, Any]) -> None:
    """JSON Schema counts -1784.0 as an integer; so does the server. A fraction or a boolean still is not one."""
    answer = daemon.post(route, body)
    assert answer.status == 201, answer
    assert answer.body["priority"] == int(body["priority"]) and type(answer.body["priority"]) is int
    for wrong in (1.5, True):
        refused = daemon.post(route, {**body, "priority": wrong})
        assert refused.status == 400 and "priority" in refused.error["message"], refused


@pytest.mark.e2e
def test_a_cursor_is_what_the_document_says(daemon: Daemon) -> None:
    doc = daemon.get("/v1/openapi.json").body
    cursor = next(p for p in doc["paths"]["/v1/tasks"]["get"]["parameters"] if p["name"] == "cursor")
    daemon.submit("noop")
    daemon.submit("noop")
    page = daemon.get("/v1/tasks?limit=1").body
    for given, ok in ((page["next_cursor"], True), ("", True), ("x" * 32, False), ("0" * 31, False)):
        assert bool(re.fullmatch(cursor["schema"]["pattern"], given)) is ok, given
        assert daemon.get(f"/v1/tasks?cursor={given}").status == (200 if ok else 400), given


def _schemathesis(target: Daemon, tmp_path: Path, unavailable: Callable[[str], NoReturn],
                  *extra: str) -> subprocess.CompletedProcess[str]:
    cli = Path(sys.executable).with_name("schemathesis")
    if not cli.exists():
        unavailable("schemathesis is not installed (pip install -e '.[dev]')")
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    return subprocess.run(
        [str(cli), "--no-color", "--config-file", str(config), "run", f"{target.url}/v1/openapi.json", *extra,
         "--phases", "examples,coverage,fuzzing,stateful", "--checks", "all",
         "--max-examples", str(SCHEMATHESIS_EXAMPLES), "--request-timeout", "10", "--no-shrink", "--seed", "20"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SCHEMATHESIS_DEADLINE_S,
        stdin=subprocess.DEVNULL)


@pytest.mark.e2e
@pytest.mark.parametrize("node", ["daemon", "token_daemon"], ids=["loopback-without-token", "with-token"])
def test_schemathesis_with_every_check_finds_nothing(
        node: str, request: pytest.FixtureRequest, tmp_path: Path, unavailable: Callable[[str], NoReturn]) -> None:
    target: Daemon = request.getfixturevalue(node)
    headers = bearer(TOKEN) if node == "token_daemon" else {}
    result = _schemathesis(target, tmp_path, unavailable, *(f"--header={k}: {v}" for k, v in headers.items()))
    summary = "\n".join(line[:300] for line in result.stdout.splitlines()[-80:])
    assert result.returncode == 0, f"schemathesis found problems:\n{summary}\n{result.stderr[-2000:]}"

    # the fuzzing stored what it submitted, and the daemon is still healthy afterwards
    assert call(target, "GET", "/readyz").status == 200, target.log()
    listed = call(target, "GET", "/v1/tasks?limit=5", headers=headers)
    assert listed.status == 200 and listed.body["tasks"] and json.dumps(listed.body)
