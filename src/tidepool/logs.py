"""Log output: one line per event on stderr, text or JSON, with journald priority prefixes.

Lines about a task start with `task <id>` (the stable wording the whole code base uses), so a
JSON line carries `task_id` (and `attempt_id`) as fields even where the call site passed none.
When stderr is the journal (systemd sets JOURNAL_STREAM to its device:inode), each line starts
with `<N>`, the syslog priority journald reads and strips, and the timestamp is left to journald.
`lifecycle` is an event bus listener that writes the steps of tasks the engine does not log itself
(created, leased, each phase, each plugin) at debug level, and worker starts and stops at info.

Completed tasks are logged within a budget (Completions): one line per task up to LINES_PER_S a second,
then the rest counted in one line when the second is over. A failure, a retry, a timeout or a cancel is
always logged at once. A pool finishing thousands of no-op tasks a second would otherwise spend about as
much of its event loop on writing their lines as on running them, and journald's default rate limit
(10,000 lines per 30 s for a service) would drop most of them anyway.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

from .events import Event, EventBus

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}
_ID = r"[0-9a-f]{32}\b"  # model.new_id(): 32 hex digits
_TASK_LINE = re.compile(rf"task (?P<task_id>{_ID})(?: attempt (?P<attempt_id>{_ID}))?")
_CONTEXT = ("task_id", "attempt_id", "worker_id", "plugin")

task_log = logging.getLogger("tidepool.task")
worker_log = logging.getLogger("tidepool.worker")


def stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM to the device:inode of the stream it connected."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    if not expected:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


class Outage:
    """A failure that repeats at every retry (a store away for minutes), said once when it begins and
    once when it ends, not at every poll or renewal."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._on = False

    def failing(self, message: str, *args: Any) -> None:
        if not self._on:
            self._on = True
            self._log.warning(message, *args)

    def over(self, message: str, *args: Any) -> None:
        if self._on:
            self._on = False
            self._log.info(message, *args)


# C0 controls but tab, DEL and C1 (a terminal takes 0x9b as an escape too) spelled out; line breaks as \n, \r
_VISIBLE = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c != 0x09} | {0x0A: "\\n", 0x0D: "\\r"}


def _priority(record: logging.LogRecord) -> str:
    return f"<{_PRIORITY.get(record.levelno, 6)}>"


class TextFormatter(logging.Formatter):
    def __init__(self, *, journal: bool) -> None:
        # journald stamps and ranks every line itself: no time, and the priority prefix for the level.
        super().__init__("%(name)s: %(message)s" if journal else "%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        # One line per record, its traceback included (the journal and log shippers take a line for a
        # record): what a message or an exception quotes (a command's stderr, a plugin's error) must not
        # start lines of its own that pass for records, nor send a terminal its escape sequences.
        text = super().format(record).translate(_VISIBLE)
        return _priority(record) + text if self.journal else text


class JsonFormatter(logging.Formatter):
    def __init__(self, *, journal: bool) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        entry: dict[str, Any] = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
                                 "level": record.levelname.lower(), "logger": record.name, "message": message}
        for key in _CONTEXT:
            value = getattr(record, key, None)
            if value is not None:
                entry[key] = value
        if "task_id" not in entry and (match := _TASK_LINE.match(message)) is not None:
            entry.update((k, v) for k, v in match.groupdict().items() if v is not None)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        line = json.dumps(entry, ensure_ascii=False, default=str)  # one line: json escapes newlines
        return _priority(record) + line if self.journal else line


def setup(level: str, fmt: str) -> None:
    """Configure the root logger once; calling again (SIGHUP) changes level and format."""
    journal = stderr_is_journal()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(journal=journal) if fmt == "json" else TextFormatter(journal=journal))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequests) for f in server_log.filters):
        server_log.addFilter(MalformedRequests())


class MalformedRequests(logging.Filter):
    """aiohttp logs every request it cannot parse as an ERROR with a traceback. A client's garbage is not
    the node's error, and a client sending it in a loop must not fill the journal with tracebacks: one
    info line each, naming the peer and what was wrong (the client got its 400 already)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.INFO):
            return False
        lines = (exc.message or "").strip().splitlines()
        what = lines[0].rstrip(": ") if lines else "unparseable"
        record.msg, record.args = "malformed request refused with %s (%s): %s", (exc.code, what, record.getMessage())
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info, record.exc_text = None, None
        return True


TASK_STEPS = ("task.created", "task.leased", "task.phase", "plugin.started", "plugin.finished")


def attach(bus: EventBus) -> None:
    """Log what `lifecycle` logs: the workers' starts and stops always, a task's steps only while the task
    log is at debug level (otherwise their data is not even built for it)."""
    bus.listen(lifecycle, names=("worker.started", "worker.stopped"))
    bus.listen(lifecycle, names=TASK_STEPS, wanted=lambda: task_log.isEnabledFor(logging.DEBUG))


def lifecycle(event: Event) -> None:
    """Event bus listener: one line per step. At info level a task step costs one level check."""
    name, d = event.name, event.data
    if name.startswith(("task.", "plugin.")):
        if not task_log.isEnabledFor(logging.DEBUG):
            return
        task_id = d.get("task_id")
        extra = {"task_id": task_id, "worker_id": d.get("worker_id")}
        if name == "task.created":
            task_log.debug("task %s created: type %s priority %s", task_id, d.get("type"), d.get("priority", 0),
                           extra=extra)
        elif name == "task.leased":
            task_log.debug("task %s attempt %s leased by %s (attempt %s)", task_id, d.get("attempt_id"),
                           d.get("worker_id"), d.get("attempt"), extra=extra)
        elif name == "task.phase":
            task_log.debug("task %s attempt %s phase %s", task_id, d.get("attempt_id"), d.get("phase"), extra=extra)
        elif name == "plugin.started":
            task_log.debug("task %s plugin %s started", task_id, d.get("plugin"), extra=extra)
        elif name == "plugin.finished":
            task_log.debug("task %s plugin %s finished in %.3fs", task_id, d.get("plugin"), d.get("duration_s", 0),
                           extra=extra)
    elif name == "worker.started":
        worker_log.info("worker %s started (%s, %s)", d.get("worker_id"), d.get("kind"), d.get("reason"),
                        extra={"worker_id": d.get("worker_id")})
    elif name == "worker.stopped":
        worker_log.info("worker %s stopped (%s, %s)", d.get("worker_id"), d.get("kind"), d.get("reason"),
                        extra={"worker_id": d.get("worker_id")})


LINES_PER_S = 100  # completions logged one by one in a second; the rest are counted
WINDOW_S = 1.0


class Completions:
    """The `task <id> attempt <id> -> completed` lines an operator greps for, within LINES_PER_S a second."""

    def __init__(self, logger: logging.Logger, *, lines_per_s: int = LINES_PER_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._lines_per_s = lines_per_s
        self._monotonic = monotonic
        self._window_at = monotonic()
        self._lines = 0    # said one by one in this window
        self._counted = 0  # past the budget in this window, said together once it ends

    def completed(self, task_id: str, attempt_id: str) -> None:
        if self._monotonic() - self._window_at >= WINDOW_S:
            self.flush()
        if self._lines < self._lines_per_s:
            self._lines += 1
            self._log.info("task %s attempt %s -> completed", task_id, attempt_id)
        else:
            self._counted += 1

    def flush(self, *, final: bool = False) -> None:
        """End the window if it is over (the pool calls this every second), or at once when `final` (the
        drain): the count of the completions past the budget, in one line."""
        now = self._monotonic()
        if now - self._window_at < WINDOW_S and not final:
            return
        if self._counted:
            self._log.info("%d more tasks completed in the last %.1fs (past %d a second, completions are "
                           "counted, not logged one by one)", self._counted, now - self._window_at,
                           self._lines_per_s)
        self._window_at, self._lines, self._counted = now, 0, 0
