"""What a newcomer sees first: the ready line says where the dashboard is and what the node runs."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from .conftest import Daemon

pytestmark = pytest.mark.e2e


def test_the_ready_line_gives_the_dashboard_url_and_the_types_and_schedules_defined(
        make_daemon: Callable[..., Daemon]) -> None:
    schedules = json.dumps([{"name": "nightly", "type": "noop", "cron": "0 2 * * *"}])
    daemon = make_daemon(env={"TIDEPOOL_SCHEDULES": schedules})
    daemon.start()
    (ready,) = [line for line in daemon.log(200).splitlines() if " ready: tidepool " in line]
    assert f"dashboard http://127.0.0.1:{daemon.port}/" in ready, ready
    assert "types http_probe, noop, scan, sleep, tcp_connect" in ready and "schedules nightly" in ready, ready


PROBE = {"plugins.probe": {"command": ["echo", "--host", "{target}", "{port}"]}, "types.probe": {"plugins": ["probe"]}}


@pytest.mark.parametrize(("payload", "field", "says"), [
    ({"port": 80}, "payload.target", "no value for this placeholder"),
    ({"target": "-oN/etc/cron.d/x", "port": 80}, "payload.target", "a value may not start with '-'"),
    ({"target": "a", "port": -1}, "payload.port", "a value may not start with '-'"),
    ({"target": ["a"], "port": 80}, "payload.target", "a list cannot be a command argument"),
])
def test_a_payload_its_command_cannot_take_is_a_400_naming_the_field_and_nothing_is_queued(
        make_daemon: Callable[..., Daemon], payload: dict[str, object], field: str, says: str) -> None:
    daemon = make_daemon(PROBE)
    daemon.start()
    refused = daemon.post("/v1/tasks", {"type": "probe", "payload": payload})
    assert refused.status == 400, refused
    assert refused.body["error"]["message"].startswith(f"{field}: {says}"), refused.body
    batch = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "noop"}, {"type": "probe", "payload": payload}]})
    assert batch.status == 400 and batch.body["error"]["message"].startswith(f"tasks.1.{field}: "), batch.body
    scheduled = daemon.post("/v1/schedules", {"name": "s", "type": "probe", "payload": payload, "every_s": 60})
    assert scheduled.status == 400 and field in scheduled.body["error"]["message"], scheduled.body
    assert daemon.get("/v1/tasks").body["tasks"] == [] and daemon.get("/v1/schedules").body["schedules"] == []
    assert daemon.post("/v1/tasks", {"type": "probe", "payload": {"target": "a", "port": 80}}).status == 201


def test_an_unknown_field_in_a_body_is_named_before_the_field_it_misspells(daemon: Daemon) -> None:
    refused = daemon.post("/v1/tasks", {"typ": "sleep"})
    assert refused.status == 400, refused
    assert refused.body["error"]["message"] == "typ: not a field of this request; type: Field required", refused.body
    extra = daemon.post("/v1/schedules", {"name": "s", "type": "noop", "every_s": 60, "evry_s": 5})
    assert extra.status == 400 and extra.body["error"]["message"].startswith("evry_s: not a field"), extra.body
