"""Bearer auth: with api.token_file set, every /v1 route needs the token; health stays open."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Daemon


@pytest.mark.e2e
def test_with_a_token_file_every_v1_route_needs_the_bearer_token(
        make_daemon: Callable[..., Daemon], cli: Callable[..., subprocess.CompletedProcess[str]],
        tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    daemon = make_daemon({"api": {"token_file": str(token)}})
    daemon.token = "s3cret-token"
    daemon.start()

    anonymous = daemon.request("POST", "/v1/tasks", {"type": "noop"}, authorization="")
    wrong = daemon.request("POST", "/v1/tasks", {"type": "noop"}, authorization="Bearer s3cret-tokem")
    basic = daemon.request("GET", "/v1/pool", authorization="Basic czNjcmV0LXRva2Vu")
    for refused in (anonymous, wrong, basic):
        assert refused.status == 401 and refused.error["code"] == "unauthorized", refused
    assert anonymous.body == wrong.body == basic.body, "every auth failure gets the same answer"
    assert daemon.request("GET", "/healthz", authorization="").status == 200
    assert daemon.query("SELECT count(*) FROM tasks") == [(0,)], "a refused request changed the store"

    # The CLI finds the token through the same config file.
    ok = cli("submit", "noop", "--wait", "--config", str(daemon.config_path))
    assert ok.returncode == 0, ok.stderr
    assert daemon.task(ok.stdout.split()[0])["state"] == "completed"

