"""On a shared store, required_tags are judged against every live node's resources: at submit and later."""

import time

import pytest

from .pg_fleet import Fleet

pytestmark = pytest.mark.e2e


def test_tags_only_another_node_has_are_accepted_and_run_there(fleet: Fleet) -> None:
    win_scan = {"types.win_scan": {"plugins": ["noop"], "required_tags": ["win10"]}}  # tags from the type
    plain = fleet.add("plain", **win_scan)
    windows = fleet.add("windows", **{"resources.vm": {"tags": ["win10"], "count": 1}}, **win_scan)
    fleet.start(plain, windows)
    fleet.wait("both nodes registered", lambda: fleet.nodes(plain) == {"plain": True, "windows": True})

    accepted = plain.post("/v1/tasks", {"type": "noop", "required_tags": ["win10"]})
    assert accepted.status == 201, accepted
    done = plain.wait_terminal(accepted.body["id"])
    assert done["state"] == "completed" and done["attempts"][-1]["node_id"] == "windows"

    by_type = plain.post("/v1/tasks", {"type": "win_scan"})
    assert by_type.status == 201, by_type
    assert plain.wait_terminal(by_type.body["id"])["attempts"][-1]["node_id"] == "windows"

    refused = plain.post("/v1/tasks", {"type": "noop", "required_tags": ["gpu"]})
    assert refused.status == 400 and "required_tags" in refused.body["error"]["message"]


def test_tasks_only_a_departed_node_could_serve_fail_after_prepare_timeout(fleet: Fleet) -> None:
    plain = fleet.add("plain", execution={"prepare_timeout_s": 1.0})
    windows = fleet.add("windows", **{"resources.vm": {"tags": ["win10"], "count": 1}})
    fleet.start(plain, windows)
    fleet.wait("both nodes registered", lambda: fleet.nodes(plain) == {"plain": True, "windows": True})
    later = plain.post("/v1/tasks", {"type": "noop", "required_tags": ["win10"],
                                     "available_at": "2100-01-01T00:00:00Z"})  # queued, claimed by nobody
    assert later.status == 201, later
    time.sleep(2.0)  # several of plain's passes past its prepare_timeout_s: the live Windows node counts
    assert plain.task(later.body["id"])["state"] == "pending"

    windows.stop()
    task = plain.wait_terminal(later.body["id"])
    assert (task["state"], task["error"]["code"]) == ("failed", "unserviceable"), task
