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


@pytest.mark.e2e
def test_work_directories_an_earlier_process_left_are_removed_at_start(make_daemon: Callable[..., Daemon]) -> None:
    """A SIGKILL leaves the running attempts' work directories behind: no stop phase removed them."""
    daemon = make_daemon()
    left = daemon.state_dir / "work" / "e2e-node" / "0193a1b2c3d4e5f60718293a4b5c6d7e"
    other_node = daemon.state_dir / "work" / "node-b" / "0193a1b2c3d4e5f60718293a4b5c6d7f"  # shares the dir
    other_node.mkdir(parents=True)
    left.mkdir(parents=True)
    (left / "scan.xml").write_text("<partial/>")
    daemon.start()
    assert not left.exists()
    assert other_node.exists(), "another node's running attempt keeps its directory"
    assert daemon.get("/readyz").status == 200


@pytest.mark.e2e
def test_a_relative_state_dir_gives_commands_a_workdir_they_can_use(make_daemon: Callable[..., Daemon]) -> None:
    """The example config's state_dir is "./var": a command runs in its work directory, so a relative
    {workdir} there would name a directory that does not exist (nmap -oX {workdir}/scan.xml failed)."""
    daemon = make_daemon({
        "node": {"state_dir": "var"},  # the daemon runs in daemon.root: the same directory as the tests'
        "plugins.report": {"command": ["sh", "-c", 'echo "<scan/>" > "$0/scan.xml" && cat "$0/scan.xml"',
                                       "{workdir}"]},
        "types.report": {"plugins": ["report"]},
    })
    daemon.start()
    task = daemon.submit("report")
    daemon.wait_for("the task to end", lambda: daemon.task(task["id"])["state"] in ("completed", "failed"))
    done = daemon.task(task["id"])
    assert done["state"] == "completed", done["error"]
    assert done["results"][0]["payload"] == {"text": "<scan/>\n"}
