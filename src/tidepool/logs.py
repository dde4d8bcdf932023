"""Log output: one line per event on stderr, text or JSON, with journald priority prefixes."""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM to the device:inode of the stream it connected."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


class TextFormatter(logging.Formatter):
    def __init__(self, *, journal: bool) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        return f"<{_PRIORITY.get(record.levelno, 6)}>{line}" if self.journal else line


class JsonFormatter(logging.Formatter):
    def __init__(self, *, journal: bool) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(), "level": record.levelname.lower(),
                 "logger": record.name, "message": record.getMessage()}
        for key in ("task_id", "plugin"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        line = json.dumps(entry, ensure_ascii=False)
        return f"<{_PRIORITY.get(record.levelno, 6)}>{line}" if self.journal else line


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
