"""One daemon per node id and state dir: a second one refuses to start and names the first."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Daemon


@pytest.mark.e2e
def test_a_second_daemon_with_the_same_node_id_and_state_dir_exits_2_naming_the_other_pid(
        daemon: Daemon, make_daemon: Callable[..., Daemon]) -> None:
    twin = make_daemon(root=daemon.root)  # same node.id, same state dir and database, another API port
    assert twin.db_path == daemon.db_path and twin.port != daemon.port

    result = twin.run_to_exit()
    assert result.returncode == 2, result.stderr
    assert f"pid {daemon.pid}" in result.stderr
    assert "e2e-node" in result.stderr

    assert daemon.get("/readyz").status == 200, "the first daemon is unharmed"
    task = daemon.submit("noop")
    assert daemon.wait_terminal(task["id"])["state"] == "completed"


@pytest.mark.e2e
def test_a_second_daemon_of_the_node_on_another_store_but_the_same_state_dir_exits_2(
        daemon: Daemon, make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """Its start would kill the commands running in the work directories the two share, taking them for
    what a SIGKILLed daemon left behind."""
    (tmp_path / "other").mkdir()
    twin = make_daemon({"store": {"url": f"sqlite:///{tmp_path / 'other' / 'other.db'}"},
                        "node": {"id": "e2e-node", "state_dir": str(daemon.state_dir)}}, root=tmp_path / "other")
    result = twin.run_to_exit()
    assert result.returncode == 2, result.stderr
    assert f"pid {daemon.pid}" in result.stderr and "work directories" in result.stderr
    assert daemon.get("/readyz").status == 200, "the first daemon is unharmed"


@pytest.mark.e2e
def test_a_second_daemon_reaching_the_same_database_through_a_symlink_exits_2(
        daemon: Daemon, make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """Started, it would take the first one's live leases for an earlier process's and run their tasks again."""
    alias_dir = tmp_path / "elsewhere"
    alias_dir.mkdir()
    (tmp_path / "twin").mkdir()
    (alias_dir / "alias.db").symlink_to(daemon.db_path)
    twin = make_daemon({"store": {"url": f"sqlite:///{alias_dir / 'alias.db'}"}}, root=tmp_path / "twin")
    result = twin.run_to_exit()
    assert result.returncode == 2, result.stderr
    assert f"pid {daemon.pid}" in result.stderr


@pytest.mark.e2e
def test_a_second_daemon_exits_2_even_when_the_first_ones_lock_file_was_deleted(
        daemon: Daemon, make_daemon: Callable[..., Daemon]) -> None:
    """Started, it would expire the first one's live leases as an earlier process's and run them twice."""
    (lock,) = daemon.db_path.parent.glob(f"{daemon.db_path.name}.*.lock")
    lock.unlink()
    result = make_daemon(root=daemon.root).run_to_exit()
    assert result.returncode == 2, result.stderr
    assert f"pid {daemon.pid}" in result.stderr and "already runs" in result.stderr
    assert daemon.get("/readyz").status == 200


@pytest.mark.e2e
def test_a_second_daemon_reaching_the_database_through_a_hard_link_exits_2(
        daemon: Daemon, make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """SQLite keeps the write-ahead log beside each name: two daemons writing one file through two names
    corrupted it (a probe lost half of 5,000 acknowledged tasks). Neither the lock file beside each name
    nor the node's row (in the other name's log) can see the other: the second name is refused."""
    (tmp_path / "twin" / "var").mkdir(parents=True)
    os.link(daemon.db_path, tmp_path / "twin" / "var" / "tidepool.db")
    result = make_daemon(root=tmp_path / "twin").run_to_exit()
    assert result.returncode == 2, result.stderr
    assert "2 hard links" in result.stderr and "store.url" in result.stderr
    task = daemon.submit("noop")
    assert daemon.wait_terminal(task["id"])["state"] == "completed"


@pytest.mark.e2e
@pytest.mark.parametrize(("statements", "said"), [
    (["CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)", "INSERT INTO customers (name) VALUES ('acme')"],
     "it holds tables customers"),
    (["PRAGMA user_version = 7"], "it has schema version 7 and no tasks table"),
], ids=["another-applications-tables", "a-schema-version-but-no-tasks-table"])
def test_a_file_of_another_application_is_refused_and_left_as_it_was(
        make_daemon: Callable[..., Daemon], tmp_path: Path, statements: list[str], said: str) -> None:
    foreign = tmp_path / "foreign.db"
    with contextlib.closing(sqlite3.connect(foreign)) as conn:
        for statement in statements:
            conn.execute(statement)
        conn.commit()
    before = foreign.read_bytes()
    result = make_daemon({"store": {"url": f"sqlite:///{foreign}"}}).run_to_exit()
    assert result.returncode == 2, result.stderr
    assert f"is not a tidepool database ({said})" in result.stderr
    assert foreign.read_bytes() == before
    assert not foreign.with_name("foreign.db-wal").exists()
