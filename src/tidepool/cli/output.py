"""How the `tidepool` command prints: exit codes, styles, and data from tasks and the daemon made safe to show."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

OK, TASK_FAILED, USAGE, UNREACHABLE = 0, 1, 2, 3

ERR = Console(stderr=True)
STYLE = {"completed": "green", "failed": "red", "timed_out": "red", "cancelled": "yellow", "running": "cyan"}
_VISIBLE = {c: f"\\u{c:04x}" for c in (*range(0x20), *range(0x7f, 0xa0))}  # C0, DEL and C1


def fatal(message: str) -> None:
    """Why a command (the daemon among them) could not go on; in the journal at error priority, so
    `journalctl -p warning` shows it."""
    from .. import logs

    print(f"<3>{message}" if logs.stderr_is_journal() else message, file=sys.stderr)


def complain(message: str) -> None:
    """One line on stderr, whatever the daemon or a task put in it."""
    print(visible(message), file=sys.stderr)


def stdout() -> Console:
    """Tables fit a terminal's width; piped into grep or a file, no column is cut at rich's default 80."""
    return Console(width=None if sys.stdout.isatty() else 10_000)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))  # ensure_ascii: every control character leaves as \u00XX


def visible(text: str) -> str:
    """Text from a task or the daemon with every control character spelled out as JSON spells it (ESC as
    \\u001b), so that no error message or payload can clear the screen, set the window title or overwrite
    a line. Backslashes stay as they are: a literal "\\u001b" in the data looks the same, and is as harmless."""
    return text.translate(_VISIBLE)


def text(value: str, style: str = "") -> Text:
    """Data for a rich renderable: control characters made visible, and never read as markup or emoji."""
    return Text(visible(value), style=style)


def table(*columns: Column | str) -> Table:
    """A listing: a rule under the header, one space between columns."""
    return Table(*columns, box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, show_edge=False)


def when(ts: str | None) -> str:
    """An RFC 3339 UTC time to the second, as tables show it (the JSON keeps the microseconds)."""
    return "-" if ts is None else ts[:19].replace("T", " ")


def percent(progress: dict[str, Any] | None) -> str:
    return f"{progress['fraction'] * 100:.0f}%" if progress and "fraction" in progress else ""


def took(started: str, finished: str | None) -> str:
    if finished is None:
        return "-"
    seconds = (datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds()
    return f"{seconds:.2f}s"


def result_line(result: dict[str, Any], *, chars: int = 2000) -> str:
    """One result batch as `show` prints it: plugin#sequence, whether final, and its payload's first `chars` of JSON
    (the rest is in --json)."""
    final = " (final)" if result["final"] else ""
    return f"{result['plugin']}#{result['sequence']}{final}: {json.dumps(result['payload'])[:chars]}"


def fact(key: str, value: Any) -> str:
    """One field of a task as a person reads it: "-" for none, progress and errors as sentences."""
    if value is None or value == []:
        return "-"
    if key == "progress":
        return " ".join(p for p in (percent(value), value.get("message", "")) if p) or "-"
    if key == "error":  # a command's stderr often ends its message with a newline: not worth a \u000a
        return f"{value.get('code')}: {str(value.get('message')).rstrip()}"
    if key == "required_tags":
        return ", ".join(value)
    return json.dumps(value) if isinstance(value, dict | list) else str(value)
