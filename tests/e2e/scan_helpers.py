"""What the scan tests share: profiles built of real plugins, and waiting for a scan on a live daemon.

Not a conftest: test modules import it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..process_trees import TREE
from .conftest import Daemon

SCAN_ENDED = ("succeeded", "failed", "cancelled")

# Succeeds once its flag file exists: a step that fails until the operator fixes what it needs.
GATE = "import os, sys; sys.exit(0 if os.path.exists(sys.argv[1]) else 3)"


def profiles_config(root: Path) -> dict[str, Any]:
    """Profiles of noop steps, of a command's process tree, and of a gate that fails until a flag exists."""
    tree = root / "tree.py"
    tree.write_text(TREE)
    return {
        "plugins.tree": {"command": [sys.executable, str(tree), "{pidfile}"]},
        "plugins.gate": {"command": [sys.executable, "-c", GATE, str(root / "flag")]},
        "types.gate": {"plugins": ["gate"], "max_attempts": 1, "timeout_s": 30.0, "required_tags": ["box"]},
        "resources.box": {"tags": ["box"]},
        "types.far": {"plugins": ["noop"], "required_tags": ["gpu"]},  # no resource of this node has the tag
        "profiles.far": {"steps": ["noop", "far"]},
        "profiles.three": {"steps": ["noop", "noop", "noop"]},
        "profiles.tree": {"steps": ["tree", "noop", "noop"]},
        "profiles.gated": {"steps": ["noop", "gate", "noop"]},
        "profiles.slow": {"steps": ["sleep", "noop"]},
        "execution": {"kill_grace_s": 0.5},
    }


def submit_scan(daemon: Daemon, profile: str, payload: dict[str, Any] | None = None,
                **fields: Any) -> dict[str, Any]:
    r = daemon.post("/v1/scans", {"profile": profile, "payload": payload or {}, **fields})
    assert r.status == 201, r
    scan: dict[str, Any] = r.body
    return scan


def scan(daemon: Daemon, scan_id: str) -> dict[str, Any]:
    r = daemon.get(f"/v1/scans/{scan_id}")
    assert r.status == 200, r
    found: dict[str, Any] = r.body
    return found


def wait_ended(daemon: Daemon, scan_id: str, *, timeout_s: float = 20.0) -> dict[str, Any]:
    ended: dict[str, Any] = daemon.wait_for(
        f"scan {scan_id} to end", lambda: (s := scan(daemon, scan_id))["state"] in SCAN_ENDED and s,
        timeout_s=timeout_s)
    return ended


def states(found: dict[str, Any]) -> list[str]:
    return [job["state"] for job in found["jobs"]]
