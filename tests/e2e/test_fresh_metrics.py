"""/metrics of a node that has run nothing yet: every known series is there at zero, so that rate() and
increase() see the first task end (a series born with its first increment hides that increment)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Daemon


@pytest.mark.e2e
def test_a_fresh_node_exports_its_task_and_reconciler_series_at_zero(daemon: Daemon) -> None:
    text = daemon.request("GET", "/metrics").body
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    for task_type in ("noop", "sleep"):  # built-in types: the test config defines them
        for state in ("completed", "failed", "timed_out", "cancelled"):
            key = ("tidepool_tasks_finished_total", frozenset({("type", task_type), ("state", state)}))
            assert samples.get(key) == 0, key
        assert samples.get(("tidepool_tasks_created_total", frozenset({("type", task_type)}))) == 0
    for action in ("expired", "promoted", "cancelled", "pruned", "unserviceable"):
        assert ("tidepool_reconciler_actions_total", frozenset({("action", action)})) in samples, action
    assert samples.get(("tidepool_lease_losses_total", frozenset())) == 0
