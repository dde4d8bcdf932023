"""Signals to the real daemon: SIGTERM drains (running tasks get until the drain deadline, then are interrupted
without using up an attempt), a second SIGINT cuts the drain short, SIGHUP reloads the config live or keeps the
running one when the new file is invalid."""

from __future__ import annotations

import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]
import pytest

from .conftest import Daemon, merge, to_toml
from .sdnotify import NotifySocket

RELOADING = r"RELOADING=1\nMONOTONIC_USEC=(\d+)"


def running(daemon: Daemon, task_id: str) -> bool:
    return bool(daemon.task(task_id)["phase"] == "run")


def row(daemon: Daemon, task_id: str) -> tuple[str, int, int]:
    ((state, attempt, interruptions),) = daemon.query(
        "SELECT state, attempt, interruptions FROM tasks WHERE id = ?", (task_id,))
    return state, attempt, interruptions


def attempts(daemon: Daemon, task_id: str) -> list[tuple[Any, ...]]:
    return daemon.query("SELECT id, number, status, error FROM attempts WHERE task_id = ? ORDER BY number",
                        (task_id,))


def sleeping(seconds: str) -> list[psutil.Process]:
    """Live `sleep SECONDS` processes: the unusual SECONDS makes them this test's own."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if proc.info["cmdline"] == ["sleep", seconds] and proc.status() != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


@pytest.mark.e2e
def test_sigterm_lets_short_tasks_finish_and_interrupts_long_ones_which_a_restart_runs(
        make_daemon: Callable[..., Daemon], notify: NotifySocket) -> None:
    long_s = f"4.{random.randrange(1000, 9999)}"  # a command plugin's process tree, and a Python plugin
    daemon = make_daemon({
        "pool": {"min_workers": 4, "max_workers": 4, "drain_timeout_s": 2.0},
        "plugins.longsleep": {"command": ["sleep", "{seconds}"]},
        "types.longcmd": {"plugins": ["longsleep"]},
    }, env=notify.env())
    daemon.start()
    long_cmd = daemon.submit("longcmd", {"seconds": long_s})
    long_py = daemon.submit("sleep", {"seconds": float(long_s)})
    daemon.wait_for("the long tasks to run", lambda: all(running(daemon, t["id"]) for t in (long_cmd, long_py)))
    ((cmd_attempt, *_),) = attempts(daemon, long_cmd["id"])
    workdir = daemon.state_dir / "work" / "e2e-node" / cmd_attempt
    daemon.wait_for("the command to start", lambda: sleeping(long_s) and workdir.is_dir())
    short = [daemon.submit("sleep", {"seconds": 1.0}) for _ in range(2)]
    daemon.wait_for("the short tasks to run", lambda: all(running(daemon, t["id"]) for t in short))

    sent = time.monotonic()
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(20) == 0, daemon.log()
    took = time.monotonic() - sent
    assert 1.8 <= took < 10.0, f"drain_timeout_s is 2.0 but the daemon took {took:.1f}s"
    assert notify.wait_for("STOPPING=1").at >= sent

    for t in short:  # finished within the drain deadline
        assert row(daemon, t["id"]) == ("completed", 1, 0)
    for t in (long_cmd, long_py):  # interrupted past it: pending again, no attempt used up
        assert row(daemon, t["id"]) == ("pending", 0, 1), daemon.log()
        assert [a[1:3] for a in attempts(daemon, t["id"])] == [(1, "interrupted")]
    assert sleeping(long_s) == [], "the interrupted command's process tree outlived the daemon"
    assert not workdir.exists(), "the stop phase did not run: the attempt's work directory is still there"
    assert "drain deadline passed: interrupting 2 tasks" in daemon.log()

    daemon.start()
    for t in (long_cmd, long_py):
        ended = daemon.wait_terminal(t["id"], timeout_s=15)
        assert ended["state"] == "completed"
        assert [(a["number"], a["status"]) for a in ended["attempts"]] == [(1, "interrupted"), (2, "succeeded")]
        assert ended["attempt"] == 1


@pytest.mark.e2e
def test_a_worker_leases_only_what_it_can_start_so_a_sigterm_leaves_the_rest_queued(
        make_daemon: Callable[..., Daemon]) -> None:
    # claim_batch 4 is a limit per claim, not a batch a worker holds: one worker leases one task at a time.
    daemon = make_daemon({"pool": {"min_workers": 1, "max_workers": 1, "claim_batch": 4, "drain_timeout_s": 5.0}})
    daemon.start()
    ids = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "sleep", "payload": {"seconds": 10}}] * 4}).body["ids"]

    def states() -> list[str]:
        return sorted(state for ((state, _, _),) in ([row(daemon, i)] for i in ids))

    daemon.wait_for("one task running", lambda: states() == ["pending", "pending", "pending", "running"])
    assert all(attempts(daemon, i) == [] for i in ids if row(daemon, i)[0] == "pending"), "nothing leased ahead"
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(20) == 0, daemon.log()
    assert states() == ["pending"] * 4
    assert all(row(daemon, i)[1] == 0 for i in ids)


@pytest.mark.e2e
def test_a_draining_node_refuses_to_be_resized(make_daemon: Callable[..., Daemon], notify: NotifySocket) -> None:
    daemon = make_daemon({"pool": {"min_workers": 1, "max_workers": 2, "drain_timeout_s": 30.0}}, env=notify.env())
    daemon.start()
    task = daemon.submit("sleep", {"seconds": 30})
    daemon.wait_for("the task to run", lambda: running(daemon, task["id"]))
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    notify.wait_for("STOPPING=1")
    r = daemon.request("PATCH", "/v1/pool", {"max_workers": 8})
    assert r.status == 409 and "draining" in r.error["message"], r
    pool = daemon.get("/v1/pool").body
    assert (pool["max_workers"], pool["draining"]) == (2, True)
    daemon.proc.send_signal(signal.SIGINT)  # the second: interrupts now
    assert daemon.proc.wait(10) == 0, daemon.log()


@pytest.mark.e2e
def test_a_second_sigint_cuts_the_drain_short_and_leaves_the_store_consistent(
        make_daemon: Callable[..., Daemon], notify: NotifySocket) -> None:
    daemon = make_daemon({"pool": {"min_workers": 2, "drain_timeout_s": 30.0}}, env=notify.env())
    daemon.start()
    ids = [daemon.submit("sleep", {"seconds": 30})["id"] for _ in range(2)]
    daemon.wait_for("both tasks to run", lambda: all(running(daemon, i) for i in ids))
    assert daemon.proc is not None

    daemon.proc.send_signal(signal.SIGINT)
    notify.wait_for("STOPPING=1")
    time.sleep(0.3)
    assert daemon.proc.poll() is None, "the first SIGINT drains: 30 s for running tasks"
    sent = time.monotonic()
    daemon.proc.send_signal(signal.SIGINT)
    assert daemon.proc.wait(15) == 0, daemon.log()
    assert time.monotonic() - sent < 10.0  # not the drain's 30 s

    for task_id in ids:
        assert row(daemon, task_id) == ("pending", 0, 1)
        assert [a[2] for a in attempts(daemon, task_id)] == ["interrupted"]
    assert daemon.query("SELECT count(*) FROM tasks WHERE state IN ('leased', 'running', 'cancelling')") == [(0,)]
    assert daemon.query("SELECT count(*) FROM attempts WHERE status IN ('leased', 'running')") == [(0,)]
    assert "second SIGINT: interrupting running tasks now" in daemon.log()



@pytest.mark.e2e
def test_a_task_that_does_not_stop_in_time_at_shutdown_is_interrupted_not_charged_as_a_crash(
        make_daemon: Callable[..., Daemon], notify: NotifySocket) -> None:
    """A command that ignores SIGTERM outlasts the second SIGINT's 1 s: its attempt must still be recorded
    interrupted (no attempt used), not left to expire into a crash that fails the task."""
    marker = f"7.{random.randrange(1000, 9999)}"
    daemon = make_daemon({
        "pool": {"min_workers": 1, "drain_timeout_s": 30.0},
        "execution": {"kill_grace_s": 3.0},
        "plugins.stubborn": {"command": ["/bin/sh", "-c", "trap '' TERM; sleep {seconds}; sleep {seconds}",
                                         "stubborn"]},
        "types.stubborn": {"plugins": ["stubborn"], "max_attempts": 1},
    }, env=notify.env())
    daemon.start()
    task_id = daemon.submit("stubborn", {"seconds": marker})["id"]
    daemon.wait_for("the command to run", lambda: running(daemon, task_id) and sleeping(marker))
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGINT)
    notify.wait_for("STOPPING=1")
    daemon.proc.send_signal(signal.SIGINT)
    assert daemon.proc.wait(15) == 0, daemon.log()
    assert row(daemon, task_id) == ("pending", 0, 1), daemon.log()
    assert [a[2] for a in attempts(daemon, task_id)] == ["interrupted"]
    assert sleeping(marker) == [], "the command's process tree outlived the daemon"
    assert f"task {task_id} attempt" in daemon.log() and "did not stop in time at shutdown" in daemon.log()

    daemon.start()  # before: the lease was expired at restart, which used the only attempt: failed
    daemon.wait_for("the task to run again", lambda: running(daemon, task_id))
    assert daemon.task(task_id)["state"] == "running"


BLOCKING_PLUGIN = """
import asyncio, time

async def blocks(ctx):
    await asyncio.to_thread(time.sleep, 120)  # a thread cannot be cancelled: the task never stops
"""


@pytest.mark.e2e
def test_a_plugin_blocked_in_a_thread_does_not_keep_the_stopped_daemon_alive(
        make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "blocking_plugins.py").write_text(BLOCKING_PLUGIN)
    daemon = make_daemon({
        "pool": {"min_workers": 1, "drain_timeout_s": 1.0},
        "execution": {"kill_grace_s": 0.0, "stop_timeout_s": 1.0},
        "plugins.blocks": {"python": "blocking_plugins:blocks"},
        "types.blocks": {"plugins": ["blocks"]},
    }, env={"PYTHONPATH": str(plugins)})
    daemon.start()
    task_id = daemon.submit("blocks")["id"]
    daemon.wait_for("the plugin to run", lambda: running(daemon, task_id))
    assert daemon.proc is not None
    sent = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(30) == 0, daemon.log()  # before: alive until the thread's 120 s were over
    assert time.monotonic() - sent < 15.0
    assert row(daemon, task_id) == ("pending", 0, 1), "recorded interrupted before the process left"
    assert "the process has not ended 5s after the drain" in daemon.log()

def rewrite(daemon: Daemon, overrides: dict[str, dict[str, Any]] | None = None, *, text: str | None = None) -> None:
    daemon.config_path.write_text(text if text is not None else to_toml(merge(daemon.config, overrides or {})))


def reload(daemon: Daemon, notify: NotifySocket) -> float:
    """SIGHUP; returns when RELOADING=1 (with MONOTONIC_USEC) and then READY=1 have arrived."""
    assert daemon.proc is not None
    sent = time.monotonic()
    daemon.proc.send_signal(signal.SIGHUP)
    reloading = notify.wait_for(RELOADING, after=sent, timeout_s=5)
    usec = int(re.fullmatch(RELOADING, reloading.text).group(1))  # type: ignore[union-attr]
    assert abs(usec / 1e6 - time.clock_gettime(time.CLOCK_MONOTONIC)) < 5.0
    notify.wait_for("READY=1", after=reloading.at, timeout_s=5)
    return sent


def pool(daemon: Daemon) -> dict[str, Any]:
    body: dict[str, Any] = daemon.get("/v1/pool").body
    return body


@pytest.mark.e2e
def test_sighup_resizes_the_pool_live_and_running_tasks_carry_on(
        make_daemon: Callable[..., Daemon], notify: NotifySocket) -> None:
    daemon = make_daemon({"pool": {"min_workers": 2, "max_workers": 4}}, env=notify.env())
    daemon.start()
    task = daemon.submit("sleep", {"seconds": 8.0})  # still running when the pool has shrunk
    daemon.wait_for("the task to run", lambda: running(daemon, task["id"]))

    rewrite(daemon, {"pool": {"min_workers": 6, "max_workers": 8}})
    reload(daemon, notify)
    grown = daemon.wait_for("6..8 workers", lambda: (p := pool(daemon))["workers"] >= 6 and p, timeout_s=4.0)
    assert (grown["min_workers"], grown["max_workers"]) == (6, 8)

    rewrite(daemon, {"pool": {"min_workers": 1, "max_workers": 2, "idle_timeout_s": 0.2}})
    reload(daemon, notify)
    shrunk = daemon.wait_for("at most 2 workers", lambda: (p := pool(daemon))["workers"] <= 2 and p, timeout_s=4.0)
    assert (shrunk["min_workers"], shrunk["max_workers"], shrunk["idle_timeout_s"]) == (1, 2, 0.2)
    assert shrunk["busy"] == 1, "the running task kept its worker"

    ended = daemon.wait_terminal(task["id"], timeout_s=20)
    assert ended["state"] == "completed"
    assert [(a["number"], a["status"]) for a in ended["attempts"]] == [(1, "succeeded")]
    log = daemon.log(200)
    assert re.search(r"reloaded \S+: pool\.min_workers, pool\.max_workers\n", log), log
    assert "pool.idle_timeout_s" in log.rsplit("reloaded", 1)[1]


def rejected_lines(daemon: Daemon) -> list[str]:
    return [line for line in daemon.log(500).splitlines() if "reload of " in line and " rejected, " in line]


def rejections(daemon: Daemon, n: int) -> list[str] | None:
    """The rejection lines once there are exactly `n`."""
    lines = rejected_lines(daemon)
    return lines if len(lines) == n else None


@pytest.mark.e2e
def test_sighup_with_an_invalid_file_keeps_the_running_config(
        make_daemon: Callable[..., Daemon], notify: NotifySocket) -> None:
    daemon = make_daemon({"pool": {"min_workers": 2, "max_workers": 4}}, env=notify.env())
    daemon.start()
    before = pool(daemon)
    bad = [
        (to_toml(merge(daemon.config, {"pool": {"min_workers": 5, "max_workers": 2}})),
         "pool.max_workers (2) is below pool.min_workers (5)"),
        ("[pool\nmin_workers = ", "cannot read"),
        (to_toml(merge(daemon.config, {"pool": {"max_wrokers": 3}})), "unknown key pool.max_wrokers"),
        (to_toml(merge(daemon.config, {"types.scan2": {"plugins": ["nope"]}})), "unknown plugin 'nope'"),
    ]
    for n, (text, reason) in enumerate(bad, 1):
        rewrite(daemon, text=text)
        reload(daemon, notify)
        lines: list[str] = daemon.wait_for(f"rejection {n}", partial(rejections, daemon, n), timeout_s=4.0)
        assert reason in lines[-1], lines[-1]
        after = pool(daemon)
        assert {k: after[k] for k in ("min_workers", "max_workers", "workers")} == \
            {k: before[k] for k in ("min_workers", "max_workers", "workers")}
    assert "Traceback" not in daemon.log(500), "a rejected file is one clear line, not a traceback"

    old_url = daemon.url
    rewrite(daemon, {"pool": {"max_workers": 5}, "api": {"listen": "127.0.0.1:1"},
                     "types.quick": {"plugins": ["noop"]}})
    reload(daemon, notify)
    applied = daemon.wait_for("max_workers 5", lambda: (p := pool(daemon))["max_workers"] == 5 and p, timeout_s=4.0)
    assert applied["pending_restart"] == ["api.listen"]
    assert daemon.url == old_url and daemon.get("/healthz").status == 200  # still where it was bound
    assert "api.listen changed but need a restart" in daemon.log(50)
    reload(daemon, notify)  # the same file again: api.listen is still not what the node runs with
    assert daemon.wait_for("2nd reload", lambda: "nothing changed" in daemon.log(20), timeout_s=4.0)
    assert pool(daemon)["pending_restart"] == ["api.listen"]
    task = daemon.submit("quick")  # a type the reload added: accepted and run
    assert daemon.wait_terminal(task["id"])["state"] == "completed"
    metrics = daemon.request("GET", "/metrics").body
    assert 'tidepool_config_reloads_total{result="rejected"} 4.0' in metrics
    assert 'tidepool_config_reloads_total{result="ok"} 2.0' in metrics


def ignores_sighup(pid: int) -> bool:
    """Whether the process ignores SIGHUP now (bit 0 of SigIgn in /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return bool(int(re.search(r"^SigIgn:\s*([0-9a-f]+)$", status, re.M).group(1), 16) & 1)  # type: ignore[union-attr]


@pytest.mark.e2e
def test_sighup_while_starting_neither_kills_the_daemon_nor_says_ready_early(
        make_daemon: Callable[..., Daemon], notify: NotifySocket) -> None:
    daemon = make_daemon(env=notify.env())
    with open(daemon.log_path, "ab") as log:
        daemon.proc = subprocess.Popen([sys.executable, "-m", "tidepool", "run", "--config", str(daemon.config_path)],
                                       cwd=daemon.root, env=daemon.env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 20
    while not ignores_sighup(daemon.pid):  # from the start of `run`: before it, Python's own imports
        assert daemon.proc.poll() is None and time.monotonic() < deadline, daemon.log()
        time.sleep(0.005)
    while not any(m.text.startswith("READY=1") for m in notify.messages):
        daemon.proc.send_signal(signal.SIGHUP)  # before: the default action ended the process (exit -1)
        assert daemon.proc.poll() is None, daemon.log()
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.02)
    texts = [m.text for m in notify.messages]
    assert texts[0].startswith("READY=1"), f"READY=1 went out before the node was ready: {texts}"
    if "SIGHUP while starting" in daemon.log():  # one came after the daemon's handler was in: answered now
        notify.wait_for(RELOADING, timeout_s=10)  # (those before it were ignored: the file is read at start)
    assert daemon.get("/readyz").status == 200


@pytest.mark.e2e
def test_a_reload_after_patch_says_it_set_the_pool_back_to_the_file(
        make_daemon: Callable[..., Daemon], notify: NotifySocket) -> None:
    daemon = make_daemon({"pool": {"min_workers": 2, "max_workers": 4}}, env=notify.env())
    daemon.start()
    assert daemon.request("PATCH", "/v1/pool", {"min_workers": 3, "max_workers": 9}).status == 200
    reload(daemon, notify)  # the file is unchanged
    assert (pool(daemon)["min_workers"], pool(daemon)["max_workers"]) == (2, 4)
    assert "pool sizes (back to the file's from PATCH /v1/pool)" in daemon.log(), "before: 'nothing changed'"


@pytest.mark.e2e
def test_a_daemon_on_a_unix_socket_takes_the_socket_file_away_when_it_stops(
        make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # a socket's path must fit in 108 bytes
        path = Path(short) / "api.sock"
        daemon = make_daemon({"api": {"listen": f"unix:{path}"}})
        for run in (1, 2):  # the second start finds the path free, as the first did
            with NotifySocket() as notify:
                proc = subprocess.Popen([sys.executable, "-m", "tidepool", "run", "--config", str(daemon.config_path)],
                                        cwd=daemon.root, env={**daemon.env, **notify.env()}, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                try:
                    notify.wait_for("READY=1")
                    with socket.socket(socket.AF_UNIX) as client:  # it answers there
                        client.connect(str(path))
                        client.sendall(b"GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n")
                        assert client.recv(64).startswith(b"HTTP/1.0 200"), run
                    proc.send_signal(signal.SIGTERM)
                    assert proc.wait(20) == 0
                finally:
                    proc.kill()
                    stderr = proc.communicate()[1].decode()
            assert not path.exists(), f"run {run} left its socket file behind: {stderr}"
