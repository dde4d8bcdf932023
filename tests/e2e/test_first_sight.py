"""What a newcomer sees first: the ready line says where the dashboard is and what the node runs."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from .conftest import Daemon

pytestmark = pytest.mark.e2e


def test_the_ready_line_gives_the_dashboard_url_and_the_types_and_schedules_defined(
        make_daemon: Callable[..., Daemon]) -> None:
    schedules = json.dumps([{"name": "nightly", "type": "noop", "cron": "0 2 * * *"}])
    daemon = make_daemon(env={"TIDEPOOL_SCHEDULES": schedules})
    daemon.start()
    (ready,) = [line for line in daemon.log(200).splitlines() if " ready: tidepool " in line]
    assert f"dashboard http://127.0.0.1:{daemon.port}/" in ready, ready
    assert "types noop, scan, sleep" in ready and "schedules nightly" in ready, ready
