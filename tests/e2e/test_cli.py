"""The `tidepool` command's exit codes against a live daemon, a dead address and bad configs (SPEC §5, §9)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Daemon, free_port, to_toml

Cli = Callable[..., subprocess.CompletedProcess[str]]
OK, TASK_FAILED, USAGE, UNREACHABLE = 0, 1, 2, 3


@pytest.mark.e2e
def test_submit_wait_exits_0_when_completed_and_1_when_failed(daemon: Daemon, cli: Cli) -> None:
    ok = cli("submit", "sleep", "--payload", '{"seconds": 0.2}', "--wait", "--url", daemon.url)
    assert ok.returncode == OK, ok.stderr
    task_id = ok.stdout.split()[0]
    assert daemon.task(task_id)["state"] == "completed"

    bad = cli("submit", "sleep", "--payload", '{"seconds": "x"}', "--wait", "--url", daemon.url)
    assert bad.returncode == TASK_FAILED, bad.stderr
    task = daemon.task(bad.stdout.split()[0])
    assert task["state"] == "failed"
    assert task["error"]["code"] == "invalid_argument"
    assert len(task["attempts"]) == 1, "an invalid argument must not be retried"
    assert "payload.seconds" in bad.stderr


@pytest.mark.e2e
def test_show_of_an_unknown_task_is_a_usage_error(daemon: Daemon, cli: Cli) -> None:
    shown = cli("show", "06H2NOSUCHTASK000000000000", "--url", daemon.url)
    assert shown.returncode == USAGE
    assert "not found" in shown.stderr
    assert shown.stdout == ""


@pytest.mark.e2e
def test_every_client_command_exits_3_with_one_line_naming_the_address_when_no_daemon_runs(
        tmp_path: Path, cli: Cli) -> None:
    port = free_port()  # nothing listens here
    config = tmp_path / "dead.toml"
    config.write_text(to_toml({"api": {"listen": f"127.0.0.1:{port}"}}))
    for args in (["pool"], ["show", "x"], ["submit", "noop"]):
        result = cli(*args, "--config", str(config))
        assert result.returncode == UNREACHABLE, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], (args, result.stderr)
    by_url = cli("pool", "--url", f"http://127.0.0.1:{port}")
    assert by_url.returncode == UNREACHABLE and f"127.0.0.1:{port}" in by_url.stderr


@pytest.mark.e2e
@pytest.mark.parametrize(("config", "env", "key"), [
    ({"pool": {"min_workers": 4, "max_workers": 2}}, {}, "pool.max_workers"),
    ({"pool": {"max_worker": 3}}, {}, "pool.max_worker"),
    ({}, {"TIDEPOOL_LEASE__DURATION_S": "soon"}, "lease.duration_s"),
], ids=["max-below-min", "unknown-key", "bad-env-override"])
def test_run_with_an_invalid_config_exits_2_naming_the_key(tmp_path: Path, cli: Cli, config: dict[str, dict[str, int]],
                                                            env: dict[str, str], key: str) -> None:
    path = tmp_path / "bad.toml"
    port = free_port()
    path.write_text(to_toml({"api": {"listen": f"127.0.0.1:{port}"},
                             "store": {"url": f"sqlite:///{tmp_path / 'var' / 'bad.db'}"}, **config}))
    result = cli("run", "--config", str(path), env=env)
    assert result.returncode == USAGE, result.stderr
    assert key in result.stderr
    assert not (tmp_path / "var" / "bad.db").exists(), "an invalid config must not touch the store"
    check = cli("config", "check", "--config", str(path), env=env)
    assert check.returncode == USAGE and key in check.stderr


@pytest.mark.e2e
def test_config_check_of_a_valid_file_exits_0_and_prints_the_effective_config(tmp_path: Path, cli: Cli) -> None:
    path = tmp_path / "good.toml"
    path.write_text(to_toml({"pool": {"min_workers": 3, "max_workers": 9}, "api": {"listen": "127.0.0.1:18999"}}))
    result = cli("config", "check", "--config", str(path), env={"TIDEPOOL_POOL__MAX_WORKERS": "12"})
    assert result.returncode == OK, result.stderr
    effective = json.loads(result.stdout)
    assert effective["pool"]["min_workers"] == 3
    assert effective["pool"]["max_workers"] == 12, "the environment beats the file"
    assert effective["api"]["listen"] == "127.0.0.1:18999"
