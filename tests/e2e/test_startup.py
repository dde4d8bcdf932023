"""Start-up failures: a node that cannot start says why in one line, with run's exit code (2 for a
config or usage error, 1 for anything else), and touches no task."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Daemon, free_port, to_toml


@pytest.mark.e2e
def test_a_daemon_that_cannot_bind_its_port_exits_1_in_one_line_and_claims_nothing(
        make_daemon: Callable[..., Daemon]) -> None:
    filler = make_daemon(env={"TIDEPOOL_POOL__TASK_TYPES": '["nothing"]'})  # a node that runs no type
    filler.start()
    ids = filler.post("/v1/tasks/batch", {"tasks": [{"type": "sleep", "payload": {"seconds": 5}}] * 4}).body["ids"]
    assert filler.stop() == 0

    worker = make_daemon({"pool": {"min_workers": 4}})  # same state dir, with the four tasks queued
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", worker.port))
        squatter.listen()
        result = worker.run_to_exit()
    assert result.returncode == 1
    states = dict(worker.query("SELECT id, state FROM tasks"))
    assert states == dict.fromkeys(ids, "pending"), "a node that never became ready must not hold leases"
    assert worker.query("SELECT count(*) FROM attempts") == [(0,)]
    errors = [line for line in result.stderr.splitlines() if line.startswith("tidepool:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(worker.port) in errors[0], "the line names the address it could not bind"


@pytest.mark.e2e
def test_listening_off_loopback_without_a_token_file_refuses_to_start_with_exit_2(
        tmp_path: Path, cli: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    config = tmp_path / "open.toml"
    config.write_text(to_toml({"api": {"listen": f"0.0.0.0:{free_port()}"},
                               "store": {"url": f"sqlite:///{tmp_path / 'var' / 'open.db'}"}}))
    result = cli("run", "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert "api.token_file" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "var" / "open.db").exists(), "a config error must not touch the store"


@pytest.mark.e2e
def test_a_unix_socket_that_cannot_be_made_exits_1_naming_its_path(make_daemon: Callable[..., Daemon],
                                                                    tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "api.sock"
    daemon = make_daemon({"api": {"listen": f"unix:{missing}"}})
    result = daemon.run_to_exit()
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("tidepool:")]
    assert len(errors) == 1 and str(missing) in errors[0], result.stderr


@pytest.mark.e2e
def test_a_config_error_at_start_reaches_the_journal_at_error_priority(tmp_path: Path) -> None:
    """Exit 2 stops systemd's restarts: the one line saying why must show in `journalctl -p err`."""
    config = tmp_path / "bad.toml"
    config.write_text("[pool]\nmax_workerz = 8\n")
    stderr = tmp_path / "stderr"
    stderr.touch()
    st = os.stat(stderr)
    env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    with open(stderr, "w") as out:
        result = subprocess.run([sys.executable, "-m", "tidepool", "run", "--config", str(config)], stderr=out,
                                env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert stderr.read_text().splitlines() == ["<3>tidepool: config: unknown key pool.max_workerz"]
