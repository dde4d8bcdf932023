"""What the CLI puts on a terminal from task data (control characters spelled out, markup as text); its exit codes."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from tidepool import cli
from tidepool.cli.output import visible
from tidepool.cli.tasks import Progress


@pytest.mark.parametrize(("data", "shown"), [
    ("plain text, [brackets] and \\u001b as typed", "plain text, [brackets] and \\u001b as typed"),
    ("\x1b[2J", "\\u001b[2J"),                  # ESC: clears the screen
    ("\x1b]0;title\x07", "\\u001b]0;title\\u0007"),  # OSC: sets the window title, ended by BEL
    ("done\rfake", "done\\u000dfake"),           # CR: rewrites the line
    ("a\x08b\tc\nd\x00", "a\\u0008b\\u0009c\\u000ad\\u0000"),
    ("\x7f\x80\x9b\x9f", "\\u007f\\u0080\\u009b\\u009f"),  # DEL and C1 (0x9b is a one-byte CSI)
    ("\xa0é→ü", "\xa0é→ü"),                      # printable text beyond ASCII is left alone
])
def test_visible_spells_out_every_control_character_and_nothing_else(data: str, shown: str) -> None:
    assert visible(data) == shown


def test_visible_covers_exactly_c0_del_and_c1() -> None:
    control = [*range(0x20), *range(0x7F, 0xA0)]
    assert [c for c in range(0x300) if visible(chr(c)) != chr(c)] == control
    assert all(visible(chr(c)) == f"\\u{c:04x}" for c in control)


def test_the_submit_wait_live_line_shows_a_plugin_name_and_progress_message_literally() -> None:
    progress = Progress("01TASK")
    progress.see({"event": "plugin.started", "plugin": "shout\x1b[31m"})
    line = progress.see({"event": "task.progress", "fraction": 0.5,
                         "message": "[bold red]MARKUP[/bold red] \x1b]0;PWNED\x07 \x1b[2J\r:smile:"})
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(line)  # the text only, as `| cat -v` sees it
    assert out.getvalue() == ("01TASK running    run        shout\\u001b[31m  50.0% "
                              "[bold red]MARKUP[/bold red] \\u001b]0;PWNED\\u0007 \\u001b[2J\\u000d:smile:\n")


def test_the_live_line_of_a_stream_opened_mid_attempt_says_running_from_the_first_progress_report() -> None:
    """The task read when the stream opens shows it leased (phases are written behind); its phase events
    went by before the stream opened: the progress reports still say it runs, and which plugin."""
    progress = Progress("01TASK")
    progress.see({"state": "leased", "phase": None, "progress": None})
    assert progress.see({"event": "task.progress", "plugin": "sleep", "fraction": 0.25,
                         "message": ""}).plain.split() == ["01TASK", "running", "run", "sleep", "25.0%"]
    # the attempt failed: the next one has neither phase nor plugin nor progress yet
    assert progress.see({"event": "task.retry_scheduled"}).plain.split() == ["01TASK", "retry_wait"]
    assert progress.see({"event": "task.leased"}).plain.split() == ["01TASK", "leased"]
    progress.see({"event": "task.cancel_requested"})  # a cancel stands through what the attempt still says
    progress.see({"event": "task.progress", "plugin": "sleep", "fraction": 0.5, "message": ""})
    assert progress.see({"event": "task.phase", "phase": "stop"}).plain.split()[:3] == ["01TASK", "cancelling", "stop"]


@pytest.mark.parametrize(("status", "code"), [
    (400, cli.USAGE), (401, cli.USAGE), (403, cli.USAGE), (404, cli.USAGE), (405, cli.USAGE),
    (409, cli.USAGE), (413, cli.USAGE), (415, cli.USAGE), (408, cli.UNREACHABLE),
    (429, cli.UNREACHABLE), (500, cli.UNREACHABLE), (503, cli.UNREACHABLE),
])
def test_an_error_answer_never_exits_1_which_says_the_task_ended_badly(status: int, code: int) -> None:
    assert cli.exit_code(status) == code
