"""GET /v1/openapi.json: a valid OpenAPI 3.1 document of every route, and schemathesis against the live
daemon (property-based requests): no 5xx, and every response matches the document."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest

from .api_helpers import bearer, call
from .conftest import TOKEN, Daemon

SCHEMATHESIS_BUDGET_S = 30
# Statuses the API answers on purpose beyond what a JSON schema can say: a type or tag set the node does not
# serve, pool sizes that contradict each other (400), a body over api.max_body_kb before it is read (413).
SCHEMATHESIS_CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "404", "409", "429"]

[checks.negative_data_rejection]
expected-statuses = ["400", "401", "404", "405", "409", "413", "415", "429"]
"""
SPEC_ROUTES = {
    ("post", "/v1/tasks"), ("get", "/v1/tasks"), ("post", "/v1/tasks/batch"), ("get", "/v1/tasks/{id}"),
    ("post", "/v1/tasks/{id}/cancel"), ("post", "/v1/tasks/{id}/retry"), ("get", "/v1/pool"),
    ("patch", "/v1/pool"), ("get", "/v1/events"), ("get", "/v1/nodes"), ("get", "/v1/schedules"),
    ("post", "/v1/schedules"),
    ("delete", "/v1/schedules/{name}"), ("post", "/v1/schedules/{name}/pause"),
    ("post", "/v1/schedules/{name}/resume"), ("get", "/healthz"), ("get", "/readyz"),
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


@pytest.mark.e2e
def test_the_document_is_valid_openapi_3_1_and_covers_every_route(
        daemon: Daemon, unavailable: Callable[[str], NoReturn]) -> None:
    r = daemon.get("/v1/openapi.json")
    assert r.status == 200
    doc = r.body
    assert doc["openapi"] == "3.1.0" and doc["info"]["title"] == "tidepool"
    try:  # the official OpenAPI 3.1 schema, as schemathesis ships it, checked with its JSON Schema engine
        import jsonschema_rs
        from schemathesis.specs.openapi.definitions import OPENAPI_31
    except ImportError as exc:
        unavailable(f"schemathesis is not installed (pip install -e '.[dev]'): {exc}")
    errors = [str(e) for e in jsonschema_rs.Draft202012Validator(OPENAPI_31).iter_errors(doc)]
    assert not errors, errors

    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert not SPEC_ROUTES - documented, f"routes of SPEC §5 missing from the document: {SPEC_ROUTES - documented}"
    schemas = doc["components"]["schemas"]
    for ref in _refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref

    submit = schemas["SubmitTask"]
    assert submit["additionalProperties"] is False and submit["required"] == ["type"]
    assert set(submit["properties"]["type"]["enum"]) >= {"noop", "sleep", "scan"}, "the node's task types"
    assert doc["security"] == [{"bearer": []}]
    assert doc["paths"]["/healthz"]["get"]["security"] == [] and doc["paths"]["/readyz"]["get"]["security"] == []
    for (method, path) in SPEC_ROUTES:
        if path.startswith("/v1/"):
            assert "401" in doc["paths"][path][method]["responses"], (method, path)


@pytest.mark.e2e
def test_schemathesis_finds_no_server_error_and_no_response_off_the_schema(
        token_daemon: Daemon, tmp_path: Path, unavailable: Callable[[str], NoReturn]) -> None:
    cli = Path(sys.executable).with_name("schemathesis")
    if not cli.exists():
        unavailable("schemathesis is not installed (pip install -e '.[dev]')")
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    result = subprocess.run(
        [str(cli), "--no-color", "--config-file", str(config), "run", f"{token_daemon.url}/v1/openapi.json",
         "--header", f"Authorization: Bearer {TOKEN}", "--checks", "all", "--max-examples", "30",
         "--max-time", str(SCHEMATHESIS_BUDGET_S), "--request-timeout", "5", "--no-shrink"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SCHEMATHESIS_BUDGET_S + 45,
        stdin=subprocess.DEVNULL)
    summary = "\n".join(line[:300] for line in result.stdout.splitlines()[-80:])
    assert result.returncode == 0, f"schemathesis found problems:\n{summary}\n{result.stderr[-2000:]}"

    # the fuzzing stored what it submitted, and the daemon is still healthy afterwards
    assert call(token_daemon, "GET", "/readyz").status == 200, token_daemon.log()
    listed = call(token_daemon, "GET", "/v1/tasks?limit=5", headers=bearer(TOKEN))
    assert listed.status == 200 and json.dumps(listed.body)
