"""A plugin's scope on a real daemon (SQLite): targets outside it refused at submit by every route that queues
work, and again right before the command starts, when a name has moved since its submit.

The daemon resolves names with the host's resolver (socket.getaddrinfo). The test answers `.test` names from
a file it rewrites (a sitecustomize on the daemon's PYTHONPATH), never touching the machine's /etc/hosts; any
other name goes to the host's resolver as usual.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .api_helpers import store_counts
from .conftest import Daemon

pytestmark = pytest.mark.timeout(90)

SCOPE = "127.0.0.0/30"
RESOLVER = '''
import json, os, socket

_real = socket.getaddrinfo

def _answered(host, port, *args, **kwargs):
    if isinstance(host, str) and host.endswith(".test"):
        with open(os.environ["SCOPE_TEST_HOSTS"]) as hosts:
            found = json.load(hosts).get(host)
        if not found:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, int(port or 0))) for a in found]
    return _real(host, port, *args, **kwargs)

socket.getaddrinfo = _answered
'''
LEARNER = '''
async def learn(ctx):
    """What a discovery step learns: the next step's target, handed on in the scan's scope."""
    ctx.scope["target"] = ctx.payload["next"]
'''


class Hosts:
    """The names the daemon's resolver answers, in a file it reads at every resolution."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.set({})

    def set(self, answers: dict[str, list[str]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(answers))
        tmp.replace(self.path)  # the daemon reads the old file or the new one, never half of one


@pytest.fixture
def hosts(tmp_path: Path) -> Hosts:
    return Hosts(tmp_path / "hosts.json")


@pytest.fixture
def scoped_daemon(make_daemon: Callable[..., Daemon], hosts: Hosts, tmp_path: Path) -> Daemon:
    seam = tmp_path / "seam"
    seam.mkdir()
    (seam / "sitecustomize.py").write_text(textwrap.dedent(RESOLVER))
    (seam / "scope_learner.py").write_text(textwrap.dedent(LEARNER))
    ran = tmp_path / "ran"
    ran.mkdir()
    daemon = make_daemon({
        "execution": {"scope": [SCOPE]},
        # The command leaves a file named after its task: proof that it ran.
        "plugins.scoped": {"command": ["touch", f"{ran}/{{task_id}}", "{target}"], "scope_fields": ["target"]},
        "plugins.many": {"command": ["true"], "scope": ["127.0.0.0/8"], "scope_fields": ["targets"]},
        "plugins.learn": {"python": "scope_learner:learn"},
        "types.scoped": {"plugins": ["scoped"]},
        "types.many": {"plugins": ["many"]},
        "types.later": {"plugins": ["sleep", "scoped"]},
        "profiles.chain": {"steps": ["learn", "scoped"]},
    }, env={"PYTHONPATH": str(seam), "SCOPE_TEST_HOSTS": str(hosts.path)})
    daemon.start()
    return daemon


def ran(daemon: Daemon, task_id: str) -> bool:
    return (daemon.root / "ran" / task_id).exists()


def refusal(response: Any) -> tuple[int, str, str]:
    error = response.body["error"]
    return response.status, error["code"], error["message"]


def test_a_target_outside_is_refused_at_submit_naming_the_field_and_nothing_is_queued(
        scoped_daemon: Daemon, hosts: Hosts) -> None:
    daemon = scoped_daemon
    hosts.set({"far.test": ["10.1.1.1"], "split.test": ["127.0.0.1", "10.1.1.1"], "near.test": ["127.0.0.2"]})
    before = store_counts(daemon)

    assert refusal(daemon.post("/v1/tasks", {"type": "scoped", "payload": {"target": "8.8.8.8"}})) == (
        400, "out_of_scope", f"payload.target: 8.8.8.8 is outside the scope ({SCOPE}) (plugin scoped)")
    assert refusal(daemon.post("/v1/tasks", {"type": "scoped", "payload": {"target": "far.test"}})) == (
        400, "out_of_scope", f"payload.target: 'far.test' resolves to 10.1.1.1, outside the scope ({SCOPE}) "
                             "(plugin scoped)")
    assert refusal(daemon.post("/v1/tasks", {"type": "scoped", "payload": {"target": "split.test"}}))[2] == (
        f"payload.target: 'split.test' resolves to 10.1.1.1, outside the scope ({SCOPE}) (plugin scoped)")
    status, code, message = refusal(daemon.post("/v1/tasks", {"type": "scoped", "payload": {"target": "gone.test"}}))
    assert (status, code) == (400, "out_of_scope")
    assert message.startswith("payload.target: 'gone.test' does not resolve")
    assert refusal(daemon.post("/v1/tasks", {"type": "many", "payload": {"targets": ["127.0.0.9", "10.0.0.0/8"]}})) \
        == (400, "out_of_scope", "payload.targets.1: 10.0.0.0/8 is not wholly inside the scope (127.0.0.0/8) "
                                 "(plugin many)")
    batch = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "scoped", "payload": {"target": "near.test"}},
                                                      {"type": "scoped", "payload": {"target": "far.test"}}]})
    assert refusal(batch)[:2] == (400, "out_of_scope")
    assert refusal(batch)[2].startswith("tasks.1.payload.target: 'far.test' resolves to 10.1.1.1")
    scan = daemon.post("/v1/scans", {"profile": "chain", "payload": {"next": "near.test", "target": "8.8.8.8"}})
    assert refusal(scan)[:2] == (400, "out_of_scope")
    assert refusal(scan)[2].startswith("payload.target: 8.8.8.8 is outside")
    schedule = daemon.post("/v1/schedules", {"name": "nightly", "type": "scoped", "every_s": 3600,
                                             "payload": {"target": "far.test"}})
    assert refusal(schedule)[:2] == (400, "out_of_scope")

    assert store_counts(daemon) == before  # nothing queued
    assert daemon.get("/v1/scans").body["scans"] == [] and daemon.get("/v1/schedules").body["schedules"] == []

    inside = daemon.submit("scoped", {"target": "near.test"})
    assert daemon.wait_terminal(inside["id"])["state"] == "completed"
    assert ran(daemon, inside["id"])


def test_a_name_that_moves_outside_after_its_submit_fails_the_attempt_without_running_it(
        scoped_daemon: Daemon, hosts: Hosts) -> None:
    daemon = scoped_daemon
    hosts.set({"moving.test": ["127.0.0.1"]})
    task = daemon.submit("later", {"target": "moving.test", "seconds": 1.0})  # sleep first, then the command
    hosts.set({"moving.test": ["203.0.113.7"]})  # while it sleeps, the name moves

    ended = daemon.wait_terminal(task["id"])
    assert ended["state"] == "failed"
    assert ended["error"]["code"] == "out_of_scope"
    assert ended["error"]["message"] == (f"payload.target: 'moving.test' resolves to 203.0.113.7, outside the "
                                         f"scope ({SCOPE})")
    assert len(ended["attempts"]) == 1  # not retried
    assert not ran(daemon, task["id"])


def test_a_scan_step_whose_target_was_learned_is_checked_when_it_starts(scoped_daemon: Daemon, hosts: Hosts) -> None:
    daemon = scoped_daemon
    hosts.set({"near.test": ["127.0.0.1"], "far.test": ["10.1.1.1"]})
    scans = {}
    for name in ("near.test", "far.test"):
        created = daemon.post("/v1/scans", {"profile": "chain", "payload": {"next": name}})
        assert created.status == 201, created.body  # the target is not in the payload yet: nothing to check
        scans[name] = created.body["id"]

    def ended(scan_id: str) -> dict[str, Any]:
        def finished() -> dict[str, Any] | None:
            scan: dict[str, Any] = daemon.get(f"/v1/scans/{scan_id}").body
            return scan if scan["state"] in ("succeeded", "failed", "cancelled") else None
        result: dict[str, Any] = daemon.wait_for(f"scan {scan_id} ended", finished)
        return result

    near, far = ended(scans["near.test"]), ended(scans["far.test"])
    assert near["state"] == "succeeded" and ran(daemon, near["jobs"][1]["task_id"])
    assert far["state"] == "failed"
    step = daemon.task(far["jobs"][1]["task_id"])
    assert step["error"]["code"] == "out_of_scope"
    assert step["error"]["message"].startswith("payload.target: 'far.test' resolves to 10.1.1.1, outside")
    assert not ran(daemon, step["id"])
