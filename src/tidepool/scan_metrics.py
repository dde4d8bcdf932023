"""The scans' series of a node's metrics: scans created and ended, and their steps ended, by profile.

Every profile this node defines gets its series, at zero, before its first scan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import product
from typing import Any

from .metric_series import UNKNOWN, Counter

SCAN_ENDS = ("cancelled", "failed", "succeeded")
JOB_ENDS = ("cancelled", "failed", "success", "timeout")  # a job skipped is told by its scan's end


class ScanMetrics:
    def __init__(self) -> None:
        self.created = Counter("tidepool_scans_created", "Scans created on this node (submitted to its API "
                               "or started by a schedule), by profile.", "profile")
        self.finished = Counter("tidepool_scans_finished", "Scans that ended, by profile and state, as this "
                                "node saw them end.", "profile", "state")
        self.steps = Counter("tidepool_scan_steps_finished", "Scan steps (jobs) that ended, by profile and the "
                             "job's state, as this node saw them end.", "profile", "state")
        self.series = (self.created, self.finished, self.steps)
        self.handlers: dict[str, Callable[[dict[str, Any], float], None]] = {
            "scan.created": self._scan_created,
            "scan.step": self._scan_step,
            "scan.finished": self._scan_finished,
        }

    def know(self, profiles: Iterable[str]) -> None:
        profiles = list(profiles)
        self.created.know((p,) for p in profiles)
        self.finished.know(product(profiles, SCAN_ENDS))
        self.steps.know(product(profiles, JOB_ENDS))

    def _scan_created(self, d: dict[str, Any], ts: float) -> None:
        self.created.inc((d.get("profile") or UNKNOWN,))

    def _scan_step(self, d: dict[str, Any], ts: float) -> None:
        if d.get("state") in JOB_ENDS:  # a step's task queued is counted as a task created
            self.steps.inc((d.get("profile") or UNKNOWN, d["state"]))

    def _scan_finished(self, d: dict[str, Any], ts: float) -> None:
        self.finished.inc((d.get("profile") or UNKNOWN, d.get("state") or UNKNOWN))
