"""One daemon per node id and state dir (SPEC §9): a second one refuses to start and names the first."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Daemon


@pytest.mark.e2e
def test_a_second_daemon_with_the_same_node_id_and_state_dir_exits_2_naming_the_other_pid(
        daemon: Daemon, make_daemon: Callable[..., Daemon]) -> None:
    twin = make_daemon(root=daemon.root)  # same node.id, same state dir and database, another API port
    assert twin.db_path == daemon.db_path and twin.port != daemon.port

    result = subprocess.run([sys.executable, "-m", "tidepool", "run", "--config", str(twin.config_path)],
                            cwd=twin.root, env=twin.env, capture_output=True, text=True, timeout=30,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert f"pid {daemon.pid}" in result.stderr
    assert "e2e-node" in result.stderr

    assert daemon.get("/readyz").status == 200, "the first daemon is unharmed"
    task = daemon.submit("noop")
    assert daemon.wait_terminal(task["id"])["state"] == "completed"


@pytest.mark.e2e
def test_a_second_daemon_reaching_the_same_database_through_a_symlink_exits_2(
        daemon: Daemon, make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """Started, it would take the first one's live leases for an earlier process's and run their tasks again."""
    alias_dir = tmp_path / "elsewhere"
    alias_dir.mkdir()
    (tmp_path / "twin").mkdir()
    (alias_dir / "alias.db").symlink_to(daemon.db_path)
    twin = make_daemon({"store": {"url": f"sqlite:///{alias_dir / 'alias.db'}"}}, root=tmp_path / "twin")
    result = subprocess.run([sys.executable, "-m", "tidepool", "run", "--config", str(twin.config_path)],
                            cwd=twin.root, env=twin.env, capture_output=True, text=True, timeout=30,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert f"pid {daemon.pid}" in result.stderr
