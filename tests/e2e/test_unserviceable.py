"""A queued task whose tags this node's resources no longer have fails after prepare_timeout_s."""

import time
from collections.abc import Callable

import pytest

from .conftest import Daemon

pytestmark = pytest.mark.e2e

QUICK = {"execution": {"prepare_timeout_s": 1.0}, "reconciler": {"interval_s": 0.2}}


def test_a_restart_without_the_resource_fails_its_queued_tasks(make_daemon: Callable[..., Daemon]) -> None:
    with_vm = make_daemon({**QUICK, "resources.vm": {"tags": ["win10"], "count": 1}})
    with_vm.start()
    later = with_vm.submit("noop", required_tags=["win10"], available_at="2100-01-01T00:00:00Z")  # not due
    time.sleep(1.5)  # passes past prepare_timeout_s: a resource that exists keeps the task queued
    assert with_vm.task(later["id"])["state"] == "pending"
    with_vm.stop()

    without = make_daemon(QUICK)  # the same state dir and database, the resource gone from the config
    without.start()
    task = without.wait_terminal(later["id"])
    assert (task["state"], task["error"]["code"]) == ("failed", "unserviceable"), task
    assert f"task {later['id']} -> failed (unserviceable" in without.log()
