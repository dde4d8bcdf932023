"""Log lines as an operator's tools read them: JSON that parses with the task id as a field, journald
priority prefixes exactly when stderr is the journal, and one line per step of a task."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidepool import logs
from tidepool.events import EventBus
from tidepool.model import new_id


def record(message: str, *args: object, level: int = logging.INFO, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("tidepool.engine", level, __file__, 1, message, args, None)
    rec.__dict__.update(extra)
    return rec


def test_json_lines_parse_and_carry_the_task_and_attempt_of_the_message() -> None:
    task_id, attempt_id = new_id(), new_id()
    line = logs.JsonFormatter(journal=False).format(record("task %s attempt %s -> %s", task_id, attempt_id,
                                                           "completed"))
    entry = json.loads(line)
    assert entry["level"] == "info"
    assert entry["logger"] == "tidepool.engine"
    assert entry["message"] == f"task {task_id} attempt {attempt_id} -> completed"
    assert (entry["task_id"], entry["attempt_id"]) == (task_id, attempt_id)
    assert entry["ts"].endswith("+00:00")


def test_json_takes_ids_passed_as_extra_and_leaves_other_lines_without_one() -> None:
    task_id = new_id()
    entry = json.loads(logs.JsonFormatter(journal=False).format(
        record("plugin %s started", "nmap", task_id=task_id, plugin="nmap", level=logging.DEBUG)))
    assert (entry["level"], entry["task_id"], entry["plugin"]) == ("debug", task_id, "nmap")
    for message in ("node a ready", "task types loaded", "tasks 3 running"):
        assert "task_id" not in json.loads(logs.JsonFormatter(journal=False).format(record(message)))


def test_json_keeps_a_traceback_inside_its_one_line() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        rec = record("task %s attempt %s: plugin %s raised", new_id(), new_id(), "x", level=logging.ERROR)
        rec.exc_info = sys.exc_info()
    line = logs.JsonFormatter(journal=True).format(rec)
    assert "\n" not in line
    assert line.startswith("<3>{")
    entry = json.loads(line[3:])
    assert "ValueError: boom" in entry["exception"]


@pytest.mark.parametrize(("level", "prefix"), [(logging.DEBUG, "<7>"), (logging.INFO, "<6>"),
                                               (logging.WARNING, "<4>"), (logging.ERROR, "<3>"),
                                               (logging.CRITICAL, "<2>")])
def test_journal_text_lines_start_with_the_priority_and_leave_the_time_to_journald(level: int, prefix: str) -> None:
    assert logs.TextFormatter(journal=True).format(record("node a ready", level=level)) == \
        f"{prefix}tidepool.engine: node a ready"


@pytest.mark.parametrize("journal", [False, True])
def test_a_text_traceback_stays_on_its_records_line_and_cannot_forge_another(journal: bool) -> None:
    """A plugin's exception message is the plugin's to choose: a line break in it, or an escape sequence,
    must not start a record of its own (journald would file that line at info, as its own entry)."""
    try:
        raise RuntimeError("line1\n2026-12-01 01:00:00,000 CRITICAL tidepool.service: FORGED\x1b]0;title\x07\x9b2J")
    except RuntimeError:
        rec = record("plugin raised", level=logging.ERROR)
        rec.exc_info = sys.exc_info()
    text = logs.TextFormatter(journal=journal).format(rec)
    assert "\n" not in text and "\x1b" not in text and "\x07" not in text and "\x9b" not in text
    assert text.startswith("<3>tidepool.engine: plugin raised\\nTraceback" if journal else "20")
    assert "RuntimeError: line1\\n2026-12-01 01:00:00,000 CRITICAL tidepool.service: FORGED\\x1b]0;title\\x07\\x9b2J" \
        in text


def test_plain_text_lines_carry_time_and_level_and_no_priority() -> None:
    plain = logs.TextFormatter(journal=False).format(record("node a ready", level=logging.WARNING))
    assert not plain.startswith("<") and " WARNING tidepool.engine: node a ready" in plain



@pytest.mark.parametrize("journal", [False, True])
def test_a_message_quoting_multiline_output_stays_one_line_and_cannot_forge_another(journal: bool) -> None:
    stderr = "line1\n2026-01-01 00:00:00,000 ERROR tidepool.service: forged\r\n"
    text = logs.TextFormatter(journal=journal).format(
        record(f"task x failed: scan exited with status 3: {stderr}", level=logging.WARNING))
    assert "\n" not in text and "\r" not in text
    assert text.endswith("status 3: line1\\n2026-01-01 00:00:00,000 ERROR tidepool.service: forged\\r\\n")

CHILD = """
import logging
from tidepool import logs
logs.setup("info", "{fmt}")
logging.getLogger("tidepool.test").info("task %s attempt %s -> completed", "{task}", "{attempt}")
logging.getLogger("tidepool.test").warning("guard memory tripped")
logging.getLogger("tidepool.test").debug("not shown at info")
"""


def run_child(tmp_path: Path, fmt: str, journal_stream: str | None) -> list[str]:
    """Log from a real process whose stderr is a file, as systemd would connect it."""
    stderr = tmp_path / f"stderr-{fmt}-{journal_stream is not None}"
    stderr.touch()
    st = os.stat(stderr)
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    if journal_stream is not None:
        env["JOURNAL_STREAM"] = journal_stream.format(dev=st.st_dev, ino=st.st_ino)
    code = CHILD.format(fmt=fmt, task=new_id(), attempt=new_id())
    with open(stderr, "w") as out:
        subprocess.run([sys.executable, "-c", code], stderr=out, env=env, check=True, timeout=30)
    return stderr.read_text().splitlines()


def test_priority_prefixes_only_when_stderr_is_the_journal(tmp_path: Path) -> None:
    journal = run_child(tmp_path, "text", "{dev}:{ino}")
    assert [line[:3] for line in journal] == ["<6>", "<4>"]
    assert journal[1] == "<4>tidepool.test: guard memory tripped"
    other_file = run_child(tmp_path, "text", "{dev}:1")  # JOURNAL_STREAM names another stream
    assert len(other_file) == 2 and not any(line.startswith("<") for line in other_file)
    unset = run_child(tmp_path, "text", None)
    assert len(unset) == 2 and not any(line.startswith("<") for line in unset)


def test_json_in_the_journal(tmp_path: Path) -> None:
    lines = run_child(tmp_path, "json", "{dev}:{ino}")
    assert [line[:4] for line in lines] == ["<6>{", "<4>{"]
    first, second = (json.loads(line[3:]) for line in lines)
    assert first["level"] == "info" and first["task_id"] and first["attempt_id"]
    assert second == {**second, "level": "warning", "message": "guard memory tripped"}
    assert "task_id" not in second


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """logs.setup() owns the root logger; give pytest its handlers and level back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_setup_again_replaces_the_handler_and_changes_the_level(root_logger: logging.Logger) -> None:
    logs.setup("info", "text")
    logs.setup("debug", "json")
    assert len(root_logger.handlers) == 1
    assert isinstance(root_logger.handlers[0].formatter, logs.JsonFormatter)
    assert root_logger.level == logging.DEBUG
    assert logging.getLogger("aiohttp.access").level == logging.WARNING


def test_each_step_of_a_task_is_one_debug_line_with_the_task_id_first(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    bus.listen(logs.lifecycle)
    task_id, attempt_id, worker = new_id(), new_id(), "node/w1"
    def phase(name: str) -> tuple[str, dict[str, object]]:
        return "task.phase", {"attempt_id": attempt_id, "phase": name}

    steps: list[tuple[str, dict[str, object]]] = [
        ("task.created", {"type": "noop", "priority": 5}),
        ("task.leased", {"attempt_id": attempt_id, "attempt": 1}),
        phase("initialize"), phase("prepare"), phase("run"),
        ("plugin.started", {"plugin": "noop"}),
        ("plugin.finished", {"plugin": "noop", "duration_s": 0.0012}),
        phase("stop"),
    ]
    with caplog.at_level(logging.DEBUG, logger="tidepool"):
        bus.publish("worker.started", worker_id=worker, kind="baseline", reason="start")
        for name, data in steps:
            bus.publish(name, task_id=task_id, worker_id=None if name == "task.created" else worker, **data)
        bus.publish("worker.stopped", worker_id=worker, kind="baseline", reason="shutdown")
    assert [r.getMessage() for r in caplog.records] == [
        "worker node/w1 started (baseline, start)",
        f"task {task_id} created: type noop priority 5",
        f"task {task_id} attempt {attempt_id} leased by node/w1 (attempt 1)",
        f"task {task_id} attempt {attempt_id} phase initialize",
        f"task {task_id} attempt {attempt_id} phase prepare",
        f"task {task_id} attempt {attempt_id} phase run",
        f"task {task_id} plugin noop started",
        f"task {task_id} plugin noop finished in 0.001s",
        f"task {task_id} attempt {attempt_id} phase stop",
        "worker node/w1 stopped (baseline, shutdown)",
    ]
    task_records = [r for r in caplog.records if r.name == "tidepool.task"]
    assert all(r.levelno == logging.DEBUG and r.task_id == task_id for r in task_records)  # type: ignore[attr-defined]


def test_at_info_level_task_steps_are_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    bus.listen(logs.lifecycle)
    with caplog.at_level(logging.INFO, logger="tidepool"):
        bus.publish("task.phase", task_id=new_id(), worker_id="w", attempt_id=new_id(), phase="run")
        bus.publish("worker.started", worker_id="node/w9", kind="demand", reason="busy")
    assert [r.getMessage() for r in caplog.records] == ["worker node/w9 started (demand, busy)"]


def test_an_outage_is_said_when_it_begins_and_when_it_ends_not_at_every_retry(
        caplog: pytest.LogCaptureFixture) -> None:
    outage = logs.Outage(logging.getLogger("tidepool.test"))
    with caplog.at_level(logging.INFO, logger="tidepool.test"):
        outage.over("back")  # nothing failed yet: nothing to say
        for attempt in range(5):
            outage.failing("store away: %s", attempt)
        outage.over("back")
        outage.over("back")
        outage.failing("store away: %s", "again")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "store away: 0"), ("INFO", "back"), ("WARNING", "store away: again")]
