"""An SQLite file the daemon can no longer write to: it says so (503 naming why to a caller with the token,
/readyz, /metrics) rather than acknowledging tasks that a restart would not find."""

from __future__ import annotations

import pytest

from .conftest import TOKEN, Daemon


@pytest.mark.e2e
def test_a_database_deleted_under_the_daemon_refuses_submits_and_the_node_is_not_ready(token_daemon: Daemon) -> None:
    daemon = token_daemon
    daemon.token = TOKEN  # the store's failure is told word for word to a caller with the token only
    kept = daemon.submit("noop")
    assert daemon.wait_terminal(kept["id"])["state"] == "completed"
    daemon.delete_database()
    r = daemon.post("/v1/tasks", {"type": "noop"})
    assert (r.status, r.body["error"]["code"]) == (503, "store_unavailable"), r
    assert "deleted or replaced" in r.body["error"]["message"]
    ready = daemon.get("/readyz")
    assert ready.status == 503 and "deleted or replaced" in ready.body["reason"], ready
    metrics = daemon.request("GET", "/metrics").body
    assert "tidepool_store_up 0.0" in metrics
    assert not daemon.db_path.exists(), "no new empty database made in its place"


@pytest.mark.e2e
def test_a_write_ahead_log_deleted_under_the_daemon_refuses_submits(token_daemon: Daemon) -> None:
    """Every commit since the last checkpoint lives in the -wal file: deleted, they are gone at restart,
    and so would be every task acknowledged after it."""
    daemon = token_daemon
    daemon.token = TOKEN
    kept = daemon.submit("noop")
    assert daemon.wait_terminal(kept["id"])["state"] == "completed"
    daemon.db_path.with_name(daemon.db_path.name + "-wal").unlink()
    r = daemon.post("/v1/tasks", {"type": "noop"})
    assert (r.status, r.body["error"]["code"]) == (503, "store_unavailable"), r
    assert "-wal was deleted or replaced" in r.body["error"]["message"]
    assert daemon.get("/readyz").status == 503
