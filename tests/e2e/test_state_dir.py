"""Where the daemon keeps its files by default."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Daemon


@pytest.mark.e2e
def test_without_a_store_url_the_database_lives_in_the_state_dir(make_daemon: Callable[..., Daemon],
                                                                 tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    daemon = make_daemon({"node": {"state_dir": str(state_dir)}, "store": {"url": None}})
    daemon.start()
    assert daemon.post("/v1/tasks", {"type": "noop"}).status == 201
    assert daemon.stop() == 0
    assert (state_dir / "tidepool.db").is_file(), sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.db"))
