"""A real remote worker running a command whose stdout and stderr hold a NUL and a byte that is not UTF-8:
its ending reaches the gateway's store, SQLite or PostgreSQL, with its real outcome (never retried as an
outage until its lease runs out), each such character kept as U+FFFD."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import POSTGRES_URL, drop_schema
from ..lab import make_lab
from .gateway_helpers import WORKERS, Gateway, ended, running, submit, worker_daemon

pytestmark = pytest.mark.timeout(120)

R = "\ufffd"
SCRIPT = """
import sys
sys.stdout.buffer.write(b"open \\x00 80 \\xff")
sys.stderr.buffer.write(b"banner \\x00\\xfe\\n")
sys.exit(int(sys.argv[1]))
"""


def dirty_type(tmp_path: Path) -> dict[str, dict[str, Any]]:
    script = tmp_path / "dirty.py"
    script.write_text(SCRIPT)
    return {"plugins.dirty": {"command": [sys.executable, str(script), "{exit}"]},
            "types.dirty": {"plugins": ["dirty"]}}


@pytest.fixture(params=["sqlite", "postgres"])
def gateway_store(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    if request.param == "sqlite":
        yield {}
        return
    schema = "e2e_" + uuid.uuid4().hex[:16]
    try:
        yield {"store": {"url": f"{POSTGRES_URL}?schema={schema}"}}
    finally:
        asyncio.run(drop_schema(schema))


@pytest.mark.e2e
def test_a_remote_commands_nul_laden_output_ends_with_its_real_outcome(tmp_path: Path,
                                                                       gateway_store: dict[str, Any]) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab, **dirty_type(tmp_path), **gateway_store)
    worker = worker_daemon(tmp_path / "a", lab, "scan-a", gateway.gateway_url, **dirty_type(tmp_path))
    with running(gateway, worker):
        succeeded = ended(gateway, submit(gateway, "dirty", {"exit": 0}, max_attempts=1), timeout_s=20.0)
        failed = ended(gateway, submit(gateway, "dirty", {"exit": 3}, max_attempts=1), timeout_s=20.0)
    assert succeeded["state"] == "completed", succeeded
    assert [r["payload"] for r in succeeded["results"]] == [{"text": f"open {R} 80 {R}"}]
    assert [(a["node_id"], a["status"]) for a in succeeded["attempts"]] == [("scan-a", "succeeded")]
    assert failed["state"] == "failed", failed
    (attempt,) = failed["attempts"]
    assert (attempt["status"], attempt["exit_status"], attempt["stderr_tail"]) == ("failed", 3, f"banner {R}{R}\n")
    assert "status 3" in failed["error"]["message"] and "\x00" not in failed["error"]["message"]
