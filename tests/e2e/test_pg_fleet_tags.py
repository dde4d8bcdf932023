"""On a shared store, a submit with required_tags is judged against every live node's resources."""

import pytest

from .test_pg_cluster import Fleet, fleet  # noqa: F401  (the fixture)

pytestmark = pytest.mark.e2e


def test_tags_only_another_node_has_are_accepted_and_run_there(fleet: Fleet) -> None:  # noqa: F811
    plain = fleet.add("plain")
    windows = fleet.add("windows", **{"resources.vm": {"tags": ["win10"], "count": 1}})
    fleet.start(plain, windows)
    fleet.wait("both nodes registered", lambda: fleet.nodes(plain) == {"plain": True, "windows": True})

    accepted = plain.post("/v1/tasks", {"type": "noop", "required_tags": ["win10"]})
    assert accepted.status == 201, accepted
    done = plain.wait_terminal(accepted.body["id"])
    assert done["state"] == "completed" and done["attempts"][-1]["node_id"] == "windows"

    refused = plain.post("/v1/tasks", {"type": "noop", "required_tags": ["gpu"]})
    assert refused.status == 400 and "required_tags" in refused.body["error"]["message"]
