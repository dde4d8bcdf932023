"""A node claims only the task types it defines: on a shared store, a type another
node defines stays queued for that node, however wide this one's pool.task_types globs are."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from .conftest import Daemon


@pytest.mark.e2e
def test_a_node_leaves_a_type_it_does_not_define_to_the_node_that_does(
        make_daemon: Callable[..., Daemon], tmp_path_factory: pytest.TempPathFactory) -> None:
    defines = make_daemon({"node": {"id": "defines"}, "types.conly": {"plugins": ["noop"]}},
                          root=tmp_path_factory.mktemp("defines"))
    lacks = make_daemon({"node": {"id": "lacks"}, "store": defines.config["store"]},  # same SQLite file
                        root=tmp_path_factory.mktemp("lacks"))
    defines.start()
    soon = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    task_id = defines.submit("conly", available_at=soon, max_attempts=3)["id"]
    defines.stop()

    lacks.start()  # the only node running once the task is due
    time.sleep(2.5)  # due for 1.5 s: a node that claims it fails it at once (unknown_type, before the fix)
    task = lacks.task(task_id)
    assert (task["state"], task["attempts"]) == ("pending", []), task

    defines.start()
    assert defines.wait_terminal(task_id)["state"] == "completed"
