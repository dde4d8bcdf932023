"""`tidepool scan show|cancel|retry ID` against a live daemon: what a scan found and each step's results,
stopping a scan, and running a failed step again."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Daemon, tidepool_command
from .scan_helpers import profiles_config, scan, submit_scan, wait_ended

pytestmark = pytest.mark.e2e


def cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*tidepool_command(), *args, "--url", daemon.url], capture_output=True, text=True,
                          timeout=60, env={**daemon.env, "COLUMNS": "200"})


def test_scan_show_prints_the_steps_what_they_found_and_their_results(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    daemon.start()
    started = submit_scan(daemon, "discover", {"target": "127.0.0.1", "ports": [daemon.port]})
    ended = wait_ended(daemon, started["id"], timeout_s=60)
    assert ended["state"] == "succeeded", ended

    shown = cli(daemon, "scan", "show", ended["id"])
    assert shown.returncode == 0, shown.stderr
    assert "succeeded" in shown.stdout and "discover" in shown.stdout
    for job in ended["jobs"]:
        assert job["step"] in shown.stdout and job["task_id"] in shown.stdout
    assert "open_ports" in shown.stdout and str(daemon.port) in shown.stdout  # the scope: what it found
    assert "result of http_probe" in shown.stdout and '"status": ' in shown.stdout, shown.stdout

    as_json = json.loads(cli(daemon, "scan", "show", ended["id"], "--json").stdout)
    assert as_json["scope"] == ended["scope"] and as_json["jobs"] == ended["jobs"]
    assert [t["id"] for t in as_json["tasks"]] == [job["task_id"] for job in ended["jobs"]]
    assert all(t["results"] for t in as_json["tasks"])

    unknown = cli(daemon, "scan", "show", "01JNOSUCHSCAN0000000000000")
    assert unknown.returncode == 2 and "not found" in unknown.stderr, unknown.stderr


def test_scan_retry_runs_a_failed_step_again_and_scan_cancel_stops_one(make_daemon: Callable[..., Daemon],
                                                                      tmp_path: Path) -> None:
    daemon = make_daemon(profiles_config(tmp_path))
    daemon.start()
    failed = wait_ended(daemon, submit_scan(daemon, "gated")["id"], timeout_s=60)
    assert failed["state"] == "failed", failed
    (tmp_path / "flag").touch()  # what the step needed: now it can succeed
    retried = cli(daemon, "scan", "retry", failed["id"], "1")
    assert retried.returncode == 0, retried.stderr
    assert failed["id"] in retried.stdout and "step 1 gate" in retried.stdout
    assert wait_ended(daemon, failed["id"], timeout_s=60)["state"] == "succeeded"

    slow = submit_scan(daemon, "slow", {"seconds": 60})
    daemon.wait_for("its first step to run", lambda: scan(daemon, slow["id"])["jobs"][0]["state"] == "running",
                    timeout_s=10)
    cancelled = cli(daemon, "scan", "cancel", slow["id"])
    assert cancelled.returncode == 0, cancelled.stderr
    ended = wait_ended(daemon, slow["id"], timeout_s=30)
    assert ended["state"] == "cancelled" and [j["state"] for j in ended["jobs"]] == ["cancelled", "skipped"], ended
