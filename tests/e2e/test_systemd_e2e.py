"""The real daemon under a stand-in for systemd: a test-owned NOTIFY_SOCKET (READY, STATUS, WATCHDOG,
STOPPING), JOURNAL_STREAM log lines, and /metrics read back with the Prometheus text parser."""

from __future__ import annotations

import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import _OPENER, Daemon
from .sdnotify import Message, NotifySocket

STATUS = r"STATUS=workers \d+/\d+ busy \d+ queued \d+"


def readyz_status(daemon: Daemon) -> int | str:
    try:
        return daemon.request("GET", "/readyz", timeout_s=2.0).status
    except OSError as exc:  # not even listening
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.e2e
def test_ready_only_once_the_api_answers_then_status_then_stopping_on_sigterm(
        make_daemon: Callable[..., Daemon], notify: NotifySocket) -> None:
    readyz_when_ready: list[int | str] = []
    daemon = make_daemon({"pool": {"min_workers": 2, "max_workers": 5}}, env=notify.env())

    def on_message(message: Message) -> None:
        if message.text == "READY=1" and not readyz_when_ready:
            readyz_when_ready.append(readyz_status(daemon))  # asked the moment READY=1 lands

    notify.on_message = on_message
    daemon.start()
    notify.wait_for("READY=1")
    assert readyz_when_ready == [200], "READY=1 arrived before /readyz answered 200"
    assert notify.wait_for(STATUS).text == "STATUS=workers 2/5 busy 0 queued 0"
    assert "on uvloop" in daemon.log(), "uvloop is installed here, so it must be the loop"

    task = daemon.submit("sleep", {"seconds": 1.5})
    notify.wait_for(r"STATUS=workers \d+/5 busy 1 queued 0", timeout_s=5)
    daemon.wait_terminal(task["id"], timeout_s=10)
    notify.wait_for(r"STATUS=workers \d+/5 busy 0 queued 0", after=notify.matching(".*busy 1.*")[0].at)

    sent = time.monotonic()
    assert daemon.stop() == 0, daemon.log()
    texts = notify.texts()
    assert texts.count("READY=1") == 1
    assert texts.count("STOPPING=1") == 1
    assert notify.matching("STOPPING=1")[0].at >= sent
    assert texts.index("STOPPING=1") > texts.index("READY=1")
    statuses = [t for t in texts if t.startswith("STATUS=")]
    assert all(_is_status(t) for t in statuses), statuses
    shown = [m.at for m in notify.matching("STATUS=.*")]
    assert all(b - a >= 0.9 for a, b in itertools.pairwise(shown)), "STATUS= more than once a second"


def _is_status(text: str) -> bool:
    return re.fullmatch(r"STATUS=(draining: )?workers \d+/\d+ busy \d+ queued \d+", text) is not None


@pytest.mark.e2e
def test_watchdog_pings_every_half_interval_and_not_for_another_pid(make_daemon: Callable[..., Daemon],
                                                                     tmp_path: Path) -> None:
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    with NotifySocket() as ours, NotifySocket() as theirs:
        pinged = make_daemon(root=tmp_path / "ours", env=ours.env(WATCHDOG_USEC="400000"))
        # WATCHDOG_PID names this test process: the watchdog is not the daemon's to feed.
        silent = make_daemon(root=tmp_path / "theirs",
                             env=theirs.env(WATCHDOG_USEC="400000", WATCHDOG_PID=str(os.getpid())))
        pinged.start()
        silent.start()
        ours.wait_for("READY=1")
        theirs.wait_for("READY=1")
        window_start = time.monotonic()
        time.sleep(2.0)
        window_end = time.monotonic()
        pings = [m.at for m in ours.matching("WATCHDOG=1") if window_start <= m.at <= window_end]
        # Every 0.2 s for 2 s is about 10; loose bounds, since this counts on a real clock.
        assert 6 <= len(pings) <= 16, pings
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert 0.1 <= statistics.median(gaps) <= 0.35, gaps
        assert theirs.matching("WATCHDOG=1") == []
        assert theirs.matching(STATUS), "the other daemon notifies everything else"


def scrape(daemon: Daemon) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with _OPENER.open(daemon.url + "/metrics", timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.mark.e2e
def test_metrics_parse_and_move_with_real_tasks(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon({"pool": {"min_workers": 2, "max_workers": 6}, "retry": {"backoff_base_s": 0.05}})
    daemon.start()
    before = scrape(daemon)
    assert sample(before, "tidepool_workers", kind="baseline") == 2
    assert sample(before, "tidepool_pool_max_workers") == 6
    assert sample(before, "tidepool_store_up") == 1
    assert sample(before, "tidepool_tasks_finished_total", type="noop", state="completed") == 0

    ids = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "noop"}] * 5}).body["ids"]
    slow = daemon.submit("sleep", {"seconds": 1.0})
    bad = daemon.submit("sleep", {"seconds": -1})  # refused by the plugin: failed, never retried
    running = daemon.wait_for("the sleep task running", lambda: (m := scrape(daemon)) and
                              sample(m, "tidepool_queue_depth", state="running") == 1 and m, timeout_s=10)
    assert sample(running, "tidepool_workers_busy") == 1
    for task_id in [*ids, slow["id"], bad["id"]]:
        daemon.wait_terminal(task_id, timeout_s=15)

    after = scrape(daemon)
    assert sample(after, "tidepool_tasks_created_total", type="noop") == 5
    assert sample(after, "tidepool_tasks_created_total", type="sleep") == 2
    assert sample(after, "tidepool_tasks_finished_total", type="noop", state="completed") == 5
    assert sample(after, "tidepool_tasks_finished_total", type="sleep", state="completed") == 1
    assert sample(after, "tidepool_tasks_finished_total", type="sleep", state="failed") == 1
    assert sample(after, "tidepool_task_duration_seconds_count", type="noop") == 5
    assert sample(after, "tidepool_task_duration_seconds_count", type="sleep") == 2
    assert sample(after, "tidepool_task_duration_seconds_bucket", type="sleep", le="0.5") == 1  # the refused one
    assert sample(after, "tidepool_phase_duration_seconds_count", phase="run") == 7
    assert sample(after, "tidepool_phase_duration_seconds_sum", phase="run") >= 0.9  # the 1 s sleep
    assert sample(after, "tidepool_pickup_latency_seconds_count", type="noop") == 5
    assert sample(after, "tidepool_plugin_duration_seconds_count", plugin="sleep") == 1
    assert sample(after, "tidepool_queue_depth", state="running") == 0
    assert sample(after, "tidepool_queue_depth", state="pending") == 0


def journal_daemon(make_daemon: Callable[..., Daemon], config: dict[str, Any]) -> Daemon:
    """A daemon whose stderr is a file that JOURNAL_STREAM names, as systemd connects the journal."""
    daemon = make_daemon(config)
    daemon.log_path.touch()
    st = os.stat(daemon.log_path)
    daemon.env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    return daemon


def daemon_lines(daemon: Daemon) -> list[str]:
    return [line for line in daemon.log_path.read_text().splitlines() if not line.startswith("--- start")]


@pytest.mark.e2e
def test_json_logs_with_journal_priorities(make_daemon: Callable[..., Daemon]) -> None:
    daemon = journal_daemon(make_daemon, {"log": {"format": "json"}})
    daemon.start()
    done = daemon.submit("noop")
    refused = daemon.submit("sleep", {"seconds": -1})
    daemon.wait_terminal(done["id"])
    daemon.wait_terminal(refused["id"])
    assert daemon.stop() == 0

    entries = []
    for line in daemon_lines(daemon):
        assert line[:3] in ("<6>", "<4>", "<3>", "<7>"), line
        entry = json.loads(line[3:])
        assert {"ts", "level", "logger", "message"} <= entry.keys()
        entries.append((line[:3], entry))
    by_task = {e["task_id"]: (prefix, e) for prefix, e in entries if "task_id" in e}
    assert by_task[done["id"]][1]["message"].endswith("-> completed")
    assert by_task[done["id"]][0] == "<6>"
    prefix, failed = by_task[refused["id"]]
    assert (prefix, failed["level"]) in (("<4>", "warning"), ("<6>", "info"))
    assert any(e["message"].startswith(f"task {refused['id']} attempt") and e["level"] == "warning"
               for _, e in entries), "the plugin's refusal is a warning naming the task first"
    messages = [e["message"] for _, e in entries]
    assert any(m.startswith("node e2e-node ready:") for m in messages)
    assert any(m.startswith("node e2e-node draining:") for m in messages)
    assert messages[-1] == "node e2e-node stopped"


@pytest.mark.e2e
def test_text_logs_with_journal_priorities_and_debug_steps(make_daemon: Callable[..., Daemon]) -> None:
    daemon = journal_daemon(make_daemon, {"log": {"level": "debug"}})
    daemon.start()
    task = daemon.submit("noop")
    daemon.wait_terminal(task["id"])
    assert daemon.stop() == 0
    lines = daemon_lines(daemon)
    assert all(line[:3] in ("<7>", "<6>", "<4>", "<3>") for line in lines), lines
    first = f"<7>tidepool.task: task {task['id']} "
    steps = [line.removeprefix(first) for line in lines if line.startswith(first)]
    assert steps[0] == "created: type noop priority 0"
    assert " leased by e2e-node/w" in steps[1]
    assert [s.rsplit(" ", 1)[1] for s in steps if " phase " in s] == ["initialize", "prepare", "run", "stop"]
    assert any(s.startswith("plugin noop finished in ") for s in steps)
    assert f"<6>tidepool.engine: task {task['id']} attempt " in "\n".join(lines)


@pytest.mark.e2e
def test_why_the_daemon_did_not_start_is_an_error_in_the_journal(daemon: Daemon, tmp_path: Path) -> None:
    """`journalctl -u tidepool -p warning` must show why a start failed (here: the node already runs)."""
    stderr = tmp_path / "twin-stderr"
    stderr.touch()
    st = os.stat(stderr)
    with open(stderr, "w") as out:
        code = subprocess.run([sys.executable, "-m", "tidepool", "run", "--config", str(daemon.config_path)],
                              cwd=daemon.root, env={**daemon.env, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"},
                              stdout=subprocess.DEVNULL, stderr=out, stdin=subprocess.DEVNULL, timeout=30).returncode
    assert code == 2
    (line,) = stderr.read_text().splitlines()
    assert line.startswith("<3>tidepool: node e2e-node already runs"), line
