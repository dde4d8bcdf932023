"""Scans on a live daemon beyond its API: SIGKILL during a step and between steps, a schedule that starts
scans, the built-in discover profile from the command line, and a reload that changes the profiles."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Daemon, tidepool_command
from .scan_helpers import SCAN_ENDED, profiles_config, scan, states, submit_scan, wait_ended

pytestmark = pytest.mark.e2e


def no_job_succeeded_twice(daemon: Daemon) -> None:
    """However the daemon died, each job has at most one task that completed, and each task one success."""
    assert daemon.query("SELECT scan_id, scan_index FROM tasks WHERE scan_id IS NOT NULL AND state = 'completed' "
                        "GROUP BY scan_id, scan_index HAVING count(*) > 1") == []
    assert daemon.query("SELECT task_id FROM attempts WHERE status = 'succeeded' GROUP BY task_id "
                        "HAVING count(*) > 1") == []


def test_sigkill_during_a_step_leaves_every_scan_to_end_after_the_restart(make_daemon: Callable[..., Daemon],
                                                                          tmp_path: Path) -> None:
    daemon = make_daemon({**profiles_config(tmp_path), "retry": {"backoff_base_s": 0.2}})
    daemon.start()
    ids = [submit_scan(daemon, "slow", {"seconds": 2})["id"] for _ in range(6)]
    daemon.wait_for("every scan's first step to run",
                    lambda: all(scan(daemon, i)["jobs"][0]["state"] == "running" for i in ids), timeout_s=10)
    daemon.kill()

    daemon.start()
    for scan_id in ids:
        ended = wait_ended(daemon, scan_id, timeout_s=30)
        assert ended["state"] == "succeeded" and states(ended) == ["success", "success"], ended
        first = daemon.task(ended["jobs"][0]["task_id"])
        assert [a["status"] for a in first["attempts"]] == ["expired", "succeeded"], first
    no_job_succeeded_twice(daemon)


BETWEEN_STEPS = ("SELECT count(*) FROM scan_jobs j JOIN tasks t ON t.id = j.task_id "
                 "WHERE j.idx > 0 AND j.state = 'started' AND t.state = 'pending'")


def test_sigkill_between_steps_loses_no_scan_and_runs_no_step_twice(make_daemon: Callable[..., Daemon],
                                                                    tmp_path: Path) -> None:
    config = {**profiles_config(tmp_path), "pool": {"min_workers": 2, "max_workers": 2, "drain_timeout_s": 2.0},
              "profiles.pauses": {"steps": ["sleep", "sleep", "sleep"]}}
    daemon = make_daemon(config)
    daemon.start()
    ids = [submit_scan(daemon, "pauses", {"seconds": 0.05})["id"] for _ in range(40)]
    # A step that ended and the next one's task are one transaction: "between steps" is that task, queued.
    daemon.wait_for("scans between their steps", lambda: daemon.query(BETWEEN_STEPS)[0][0] >= 3, poll_s=0.005)
    daemon.kill()
    (between,), = daemon.query(BETWEEN_STEPS)
    assert between >= 3, "the kill found scans between their steps"

    daemon.start()
    for scan_id in ids:
        ended = wait_ended(daemon, scan_id, timeout_s=30)
        assert ended["state"] == "succeeded" and states(ended) == ["success"] * 3, ended
    no_job_succeeded_twice(daemon)
    assert daemon.query("SELECT count(*) FROM tasks WHERE scan_id IS NOT NULL") == [(120,)], "one task per step"


def test_a_schedule_with_a_profile_starts_scans_instead_of_tasks(make_daemon: Callable[..., Daemon],
                                                                tmp_path: Path) -> None:
    daemon = make_daemon(profiles_config(tmp_path), env={"TIDEPOOL_SCHEDULES": json.dumps(
        [{"name": "often", "profile": "three", "every_s": 1.0, "payload": {"target": "x"}}])})
    daemon.start()
    shown = daemon.wait_for("the schedule to start a scan",
                            lambda: (s := daemon.get("/v1/schedules").body["schedules"][0])["last_scan_id"] and s)
    assert (shown["type"], shown["profile"], shown["last_task_id"]) == (None, "three", None)
    started = wait_ended(daemon, shown["last_scan_id"])
    assert started["profile"] == "three" and started["payload"] == {"target": "x"}
    assert started["state"] == "succeeded" and states(started) == ["success"] * 3
    assert daemon.get("/v1/schedules").body["schedules"][0]["last_scan_state"] in (*SCAN_ENDED, "pending", "running")


def test_a_schedule_names_exactly_one_of_type_and_profile(make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    daemon = make_daemon(profiles_config(tmp_path))
    daemon.start()
    for body, named in (({"type": "noop", "profile": "three"}, "type: set exactly one"), ({}, "type: set exactly one"),
                        ({"profile": "nope"}, "profile: unknown profile")):
        r = daemon.post("/v1/schedules", {"name": "s", "every_s": 60, **body})
        assert r.status == 400 and r.error["message"].startswith(named), (body, r)
    assert daemon.get("/v1/schedules").body["schedules"] == []
    saved = daemon.post("/v1/schedules", {"name": "s", "every_s": 60, "profile": "three"})
    assert saved.status == 201 and saved.body["profile"] == "three"
    bad = make_daemon(env={"TIDEPOOL_SCHEDULES": json.dumps([{"name": "s", "profile": "nope", "every_s": 60}])})
    refused = bad.run_to_exit()
    assert refused.returncode != 0 and "schedules.s.profile: unknown profile 'nope'" in refused.stderr


def test_tidepool_scan_discover_wait_follows_each_step_to_the_end(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()  # a fresh node: the built-in profile, no config of scans at all
    daemon.start()
    payload = json.dumps({"target": "127.0.0.1", "ports": [daemon.port]})
    done = subprocess.run([*tidepool_command(), "scan", "discover", "--payload", payload, "--wait",
                           "--url", daemon.url], capture_output=True, text=True, timeout=60, env=daemon.env)
    assert done.returncode == 0, done.stderr
    scan_id = done.stdout.strip()
    ended = scan(daemon, scan_id)
    assert ended["state"] == "succeeded" and ended["scope"]["open_ports"] == [daemon.port]
    assert f"scan {scan_id} discover succeeded" in done.stderr
    for job in ended["jobs"]:
        assert f"{job['index']} {job['step']}" in done.stderr and job["task_id"] in done.stderr
    listed = subprocess.run([*tidepool_command(), "scans", "--url", daemon.url, "--state", "succeeded"],
                            capture_output=True, text=True, timeout=30, env={**daemon.env, "COLUMNS": "200"})
    assert scan_id in listed.stdout and "tcp_connect:success http_probe:success" in listed.stdout, listed


def test_tidepool_scan_wait_exits_1_for_a_scan_that_failed(make_daemon: Callable[..., Daemon],
                                                          tmp_path: Path) -> None:
    daemon = make_daemon(profiles_config(tmp_path))
    daemon.start()
    done = subprocess.run([*tidepool_command(), "scan", "gated", "--wait", "--url", daemon.url],
                          capture_output=True, text=True, timeout=60, env=daemon.env)
    assert done.returncode == 1, done.stderr
    assert "failed" in done.stderr and "exit_status" in done.stderr
    unknown = subprocess.run([*tidepool_command(), "scan", "nope", "--url", daemon.url], capture_output=True,
                             text=True, timeout=30, env=daemon.env)
    assert unknown.returncode == 2 and "unknown profile 'nope'" in unknown.stderr


def test_a_reload_changes_the_profiles_a_submit_may_name(make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    daemon = make_daemon(profiles_config(tmp_path))
    daemon.start()
    assert daemon.post("/v1/scans", {"profile": "quick"}).status == 400
    text = daemon.config_path.read_text() + '\n[profiles.quick]\nsteps = ["noop"]\n'
    daemon.config_path.write_text(text)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_for("the reload", lambda: "reloaded" in daemon.log(5))
    created = daemon.post("/v1/scans", {"profile": "quick"})
    assert created.status == 201, created
    assert wait_ended(daemon, created.body["id"])["state"] == "succeeded"
