"""A gateway and remote worker daemons as subprocesses, over real TLS with certificates made in the test, on a
real SQLite store: remote execution under the worker's identity, a killed worker, a partition, a gateway
restart, and an operator's revoke and disable."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tidepool.gateway import pki

from ..conftest import POSTGRES_URL, drop_schema, postgres_admin
from ..lab import make_lab
from ..process_trees import RECORD, gone, pids
from ..w1_client import Remote, client_context
from .gateway_helpers import (
    WORKERS,
    Gateway,
    Proxy,
    ended,
    lease_of,
    running,
    submit,
    task,
    wait_for,
    worker_daemon,
)

pytestmark = pytest.mark.timeout(120)

# leader -> child; the child sleeps for ever, the leader for argv[2] seconds, then succeeds.
TREE = RECORD + """
fork(lambda: sleep_forever("child"))
record("leader")
time.sleep(float(sys.argv[2]))
"""


def tree_type(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """A command type `tree` whose attempt n of task t records its processes in pids-t-n."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    return {"plugins.tree": {"command": [sys.executable, str(script), f"{tmp_path}/pids-{{task_id}}-{{attempt}}",
                                         "{seconds}"]},
            "types.tree": {"plugins": ["tree"]}}


def tree_of(tmp_path: Path, task_id: str, attempt: int) -> dict[str, int]:
    return wait_for(lambda: (found := pids(tmp_path / f"pids-{task_id}-{attempt}")).keys() >= {"leader", "child"}
                    and found, what=f"the processes of task {task_id} attempt {attempt}")


def running_on(gateway: Gateway, task_id: str) -> str:
    node: str = wait_for(lambda: (t := task(gateway, task_id))["state"] == "running" and t["node_id"],
                         what=f"task {task_id} running")
    return node


def attempts(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(a["node_id"], a["status"]) for a in body["attempts"]]


def test_tasks_run_on_remote_workers_under_their_certificate_names(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab)
    a = worker_daemon(tmp_path / "a", lab, "scan-a", gateway.gateway_url)
    b = worker_daemon(tmp_path / "b", lab, "scan-b", gateway.gateway_url)
    with running(gateway, a, b):
        done = [ended(gateway, submit(gateway, "sleep", {"seconds": 0.2})) for _ in range(6)]
        assert {t["state"] for t in done} == {"completed"}
        assert {t["node_id"] for t in done} <= {"scan-a", "scan-b"}
        assert all(attempts(t) == [(t["node_id"], "succeeded")] for t in done)
        assert {t["progress"]["fraction"] for t in done} == {1.0}  # the last report, though an ending carries none

        for method, path, body in (("GET", "/v1/tasks", None), ("POST", "/v1/tasks", {"type": "noop"}),
                                   ("GET", f"/v1/tasks/{done[0]['id']}", None), ("GET", "/v1/schedules", None)):
            answer = a.request(method, path, body)
            assert answer.status == 409, (path, answer)
            assert answer.error["code"] == "remote_worker"
            assert gateway.gateway_url in answer.error["message"]
        assert a.request("GET", "/v1/pool").status == 200
        assert a.request("GET", "/readyz").status == 200
        assert "tidepool_store_up 1.0" in a.request("GET", "/metrics").body


def test_a_killed_remote_worker_s_task_runs_again_elsewhere_once_after_its_lease(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab)
    workers = {name: worker_daemon(tmp_path / name, lab, name, gateway.gateway_url) for name in ("scan-a", "scan-b")}
    with running(gateway, *workers.values()):
        task_id = submit(gateway, "sleep", {"seconds": 2})
        holder = running_on(gateway, task_id)
        other = next(name for name in workers if name != holder)
        workers[holder].kill()
        body = ended(gateway, task_id)
        assert body["state"] == "completed", (body, workers[other].log(60))
        assert attempts(body) == [(holder, "expired"), (other, "succeeded")]


def test_a_cut_off_worker_stops_its_attempt_itself_and_its_late_writes_are_refused(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab, **tree_type(tmp_path))
    proxy = Proxy(gateway.gateway_port)
    a = worker_daemon(tmp_path / "a", lab, "scan-a", proxy.url, **tree_type(tmp_path))
    b = worker_daemon(tmp_path / "b", lab, "scan-b", gateway.gateway_url, **tree_type(tmp_path))
    try:
        with running(gateway, a):
            task_id = submit(gateway, "tree", {"seconds": "5"}, max_attempts=5)
            assert running_on(gateway, task_id) == "scan-a"
            first = tree_of(tmp_path, task_id, 1)
            attempt_id, token = lease_of(gateway, task_id)
            proxy.cut()
            b.start()
            try:
                # Before the gateway expires the lease, the cut-off worker has killed its command's tree.
                wait_for(lambda: all(gone(pid) for pid in first.values()), timeout_s=10, what="attempt 1's tree gone")
                body = ended(gateway, task_id)
            finally:
                b.stop()
            # A parked acquire of the cut-off worker may have been answered into the partition: such a lease
            # expires too. Every attempt of the cut-off worker expired; one attempt succeeded, elsewhere.
            *cut_off, last = attempts(body)
            assert body["state"] == "completed"
            assert cut_off and cut_off == [("scan-a", "expired")] * len(cut_off)
            assert last == ("scan-b", "succeeded")
            assert "lease not renewed in time" in a.log(200)

            stale = Remote(gateway.gateway_url, client_context(lab, "scan-a"))
            late = stale.call("/w1/finish", {"endings": [{"attempt_id": attempt_id, "lease_token": token,
                                                          "status": "succeeded"}]})
            assert late.status == 200 and late.body["endings"][0].get("lost"), late
            result = stale.call("/w1/results", {"attempt_id": attempt_id, "lease_token": token, "plugin": "tree",
                                                "sequence": 0, "idempotency_key": "late", "final": True,
                                                "sha256": hashlib.sha256(b"{}").hexdigest(), "payload": {}})
            assert result.status == 410 and result.error["code"] == "lease_lost", result
            assert attempts(task(gateway, task_id)) == attempts(body)
    finally:
        proxy.close()


def test_a_gateway_restart_mid_task_loses_nothing(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab, lease={"duration_s": 12.0, "renew_every_s": 3.0})
    a = worker_daemon(tmp_path / "a", lab, "scan-a", gateway.gateway_url)
    b = worker_daemon(tmp_path / "b", lab, "scan-b", gateway.gateway_url)
    with running(gateway, a, b):
        task_id = submit(gateway, "sleep", {"seconds": 4})
        holder = running_on(gateway, task_id)
        gateway.kill()
        gateway.start()
        body = ended(gateway, task_id)
        assert body["state"] == "completed"
        assert attempts(body) == [(holder, "succeeded")]
        after = [ended(gateway, submit(gateway, "sleep", {"seconds": 0.1})) for _ in range(3)]
        assert {t["state"] for t in after} == {"completed"}


def test_revoke_cancels_the_running_command_and_refuses_the_worker_from_then_on(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab, **tree_type(tmp_path))
    a = worker_daemon(tmp_path / "a", lab, "scan-a", gateway.gateway_url, **tree_type(tmp_path))
    with running(gateway, a):
        task_id = submit(gateway, "tree", {"seconds": "60"})
        assert running_on(gateway, task_id) == "scan-a"
        tree = tree_of(tmp_path, task_id, 1)
        revoked_at = time.monotonic()
        answer = gateway.request("POST", "/v1/workers/scan-a/revoke")
        assert answer.status == 202, answer
        # Far sooner than any lease or cancel deadline would end it (the gateway's cancel deadline is 60 s).
        body = ended(gateway, task_id, timeout_s=5)
        wait_for(lambda: all(gone(pid) for pid in tree.values()), timeout_s=5 - (time.monotonic() - revoked_at),
                 what="the revoked worker's command tree gone")
        assert body["state"] == "cancelled"
        scan_a = Remote(gateway.gateway_url, client_context(lab, "scan-a"))
        refused = scan_a.call("/w1/acquire", {"types": ["tree"], "max": 1})
        assert refused.status == 403 and refused.error["code"] == "worker_revoked", refused
        assert "revoked this worker" in a.log(200)


def test_disable_lets_the_running_task_finish_and_hands_out_nothing_new_until_enabled(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab)
    a = worker_daemon(tmp_path / "a", lab, "scan-a", gateway.gateway_url)
    with running(gateway, a):
        first = submit(gateway, "sleep", {"seconds": 1.5})
        running_on(gateway, first)
        assert gateway.request("PATCH", "/v1/workers/scan-a", {"state": "disabled"}).status == 200
        second = submit(gateway, "sleep", {"seconds": 0.1})
        assert ended(gateway, first)["state"] == "completed"
        # Drained: a while after its last task ended, the worker has taken nothing new.
        time.sleep(1.0)
        assert task(gateway, second)["state"] == "pending"
        assert gateway.request("PATCH", "/v1/workers/scan-a", {"state": "enabled"}).status == 200
        body = ended(gateway, second)
        assert body["state"] == "completed" and body["node_id"] == "scan-a"


def test_a_worker_whose_certificate_file_is_missing_does_not_start_and_names_the_key(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    worker = worker_daemon(tmp_path / "a", lab, "scan-a", "https://127.0.0.1:1",
                           store={"cert_file": str(tmp_path / "nowhere.pem")})
    ran = worker.run_to_exit()
    assert ran.returncode == 2, ran
    assert f"store.cert_file: {tmp_path / 'nowhere.pem'} does not exist" in ran.stderr


def test_two_gateways_on_one_postgresql_store_lease_no_attempt_twice(tmp_path: Path) -> None:
    async def reachable() -> None:
        await (await postgres_admin()).close()

    asyncio.run(reachable())
    schema = "e2e_" + uuid.uuid4().hex[:16]
    store = {"url": f"{POSTGRES_URL}?schema={schema}"}
    lab = make_lab(tmp_path, WORKERS)
    one = Gateway(tmp_path / "one", lab, node={"id": "gateway-1"}, store=store)
    two = Gateway(tmp_path / "two", lab, node={"id": "gateway-2"}, store=store)
    workers = [worker_daemon(tmp_path / name, lab, name, via.gateway_url, pool={"min_workers": 4, "max_workers": 4})
               for name, via in (("scan-a", one), ("scan-b", one), ("scan-c", two))]
    try:
        with running(one, two, *workers):
            ids = [submit(via, "sleep", {"seconds": 0.05}) for _ in range(40) for via in (one, two)]
            done = [ended(one, task_id) for task_id in ids]
    finally:
        asyncio.run(drop_schema(schema))
    assert {t["state"] for t in done} == {"completed"}
    assert all(attempts(t) == [(t["node_id"], "succeeded")] for t in done)  # one attempt each: none leased twice
    assert {t["node_id"] for t in done} == {"scan-a", "scan-b", "scan-c"}  # both gateways handed out work


def test_a_cancel_reaches_the_running_command_on_the_control_stream_not_at_the_next_renewal(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab, lease={"duration_s": 60.0, "renew_every_s": 20.0},
                      **tree_type(tmp_path))
    a = worker_daemon(tmp_path / "a", lab, "scan-a", gateway.gateway_url, **tree_type(tmp_path))
    with running(gateway, a):
        task_id = submit(gateway, "tree", {"seconds": "60"})
        running_on(gateway, task_id)
        tree = tree_of(tmp_path, task_id, 1)
        assert gateway.request("POST", f"/v1/tasks/{task_id}/cancel").status == 202
        # The next renewal is up to 20 s away: what stops the command this soon is the control stream.
        body = ended(gateway, task_id, timeout_s=5)
        assert body["state"] == "cancelled"
        assert attempts(body) == [("scan-a", "cancelled")]
        wait_for(lambda: all(gone(pid) for pid in tree.values()), timeout_s=5, what="the command tree gone")


def test_a_pending_worker_claims_nothing_and_is_not_ready_until_an_operator_enables_it(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab, gateway={"enroll": "manual"})
    a = worker_daemon(tmp_path / "a", lab, "scan-a", gateway.gateway_url, pool={"poll_interval_s": 0.5})
    with running(gateway):
        a.start(until="/healthz")
        try:
            task_id = submit(gateway, "sleep", {"seconds": 0.1})
            not_ready = wait_for(lambda: (r := a.request("GET", "/readyz")).status == 503 and r,
                                 what="the pending worker not ready")
            assert "pending" in json.dumps(not_ready.body)
            assert gateway.request("GET", "/v1/workers/scan-a").body["state"] == "pending"
            assert task(gateway, task_id)["state"] == "pending"
            assert gateway.request("PATCH", "/v1/workers/scan-a", {"state": "enabled"}).status == 200
            body = ended(gateway, task_id)
            assert body["state"] == "completed" and body["node_id"] == "scan-a"
            wait_for(lambda: a.request("GET", "/readyz").status == 200, what="the enabled worker ready")
        finally:
            a.stop()


def test_a_rotated_certificate_is_presented_after_a_reload_and_is_the_same_worker(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab)
    a = worker_daemon(tmp_path / "a", lab, "scan-a", gateway.gateway_url)
    with running(gateway, a):
        assert ended(gateway, submit(gateway, "sleep", {"seconds": 0.1}))["node_id"] == "scan-a"
        pki.issue(lab.dir, "scan-a", force=True)  # the same paths, a new key and certificate
        assert a.proc is not None
        a.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in a.log(20), what="the worker's reload")
        body = ended(gateway, submit(gateway, "sleep", {"seconds": 0.1}))
        assert body["state"] == "completed" and body["node_id"] == "scan-a"
        record = gateway.request("GET", "/v1/workers/scan-a").body
        assert len(record["fingerprints"]) == 2, record


def test_idle_workers_park_one_acquire_and_a_drain_does_not_wait_for_it(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab)
    a = worker_daemon(tmp_path / "a", lab, "scan-a", gateway.gateway_url,
                      pool={"min_workers": 4, "drain_timeout_s": 60.0})
    with running(gateway, a):
        assert ended(gateway, submit(gateway, "sleep", {"seconds": 0.1}))["state"] == "completed"

        def held() -> str:
            metrics: str = gateway.request("GET", "/metrics").body
            return next(line for line in metrics.splitlines() if line.startswith("tidepool_gateway_acquires_held"))

        wait_for(lambda: held().endswith(" 1.0"), what="the idle workers' acquire parked at the gateway")
        for _ in range(5):  # four idle workers, one connection waiting for work
            assert held().endswith(" 1.0")
            time.sleep(0.1)
        asked = time.monotonic()
        assert a.stop() == 0
        # The acquire waits up to 25 s and the drain up to 60 s: a drain that waited for it would show.
        assert time.monotonic() - asked < 10.0


def test_an_outcome_that_finds_the_gateway_away_is_written_once_it_is_back(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, WORKERS)
    gateway = Gateway(tmp_path / "gateway", lab, lease={"duration_s": 30.0, "renew_every_s": 10.0})
    a = worker_daemon(tmp_path / "a", lab, "scan-a", gateway.gateway_url)
    with running(gateway, a):
        task_id = submit(gateway, "sleep", {"seconds": 1.5})
        running_on(gateway, task_id)
        gateway.kill()
        wait_for(lambda: a.request("GET", "/v1/pool").body["busy"] == 0, what="the attempt over on the worker")
        time.sleep(5.0)  # away for longer than the outcome writer's own tries (3.75 s of waits)
        gateway.start()
        body = ended(gateway, task_id)
        assert body["state"] == "completed"
        assert attempts(body) == [("scan-a", "succeeded")]
