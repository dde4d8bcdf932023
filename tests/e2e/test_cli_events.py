"""`tidepool events`: the event stream as lines, filtered, and followed across a restart of the daemon."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from .conftest import Daemon, cli_in_background


class Lines:
    """The lines a background command prints, read on a thread of their own so a test can wait for one."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        with contextlib.suppress(ValueError, OSError):  # closed under it once the test is over
            for line in stream:
                self._lines.put(line)

    def until(self, what: str, *, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if what in line:
                return line
        pytest.fail(f"no line with {what!r} within {timeout_s}s; seen: {self.seen[-10:]}")


@pytest.mark.e2e
def test_events_prints_one_line_per_event_of_the_task_asked_for(daemon: Daemon, tmp_path: Path) -> None:
    other = daemon.submit("noop")["id"]
    daemon.wait_terminal(other)
    task_id = daemon.submit("sleep", {"seconds": 1.0})["id"]
    with cli_in_background("events", "--task", task_id[:16], "--url", daemon.url, cwd=tmp_path) as follower:
        assert follower.stdout is not None
        lines = Lines(follower.stdout)
        finished = lines.until("task.finished")
    assert f"task {task_id}" in finished and "state=completed" in finished and "type=sleep" in finished
    assert finished.split()[0].endswith("Z")  # each line starts with the event's time
    assert all(other not in line for line in lines.seen)
    assert any("task.phase" in line and "phase=run" in line for line in lines.seen)


@pytest.mark.e2e
def test_events_of_one_type_go_on_across_a_restart_of_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    with cli_in_background("events", "--type", "task.finished", "--url", daemon.url, cwd=tmp_path) as follower:
        assert follower.stdout is not None and follower.stderr is not None
        lines, said = Lines(follower.stdout), Lines(follower.stderr)
        said.until("following the events of")
        first = daemon.submit("noop")["id"]
        assert first in lines.until("task.finished")
        daemon.stop()
        daemon.start()
        said.until("the event stream is back", timeout_s=30)
        second = daemon.submit("noop")["id"]
        assert second in lines.until(second, timeout_s=30)
        assert follower.poll() is None, "the follower must outlive a restart of its daemon"
    assert all(" task.finished " in line for line in lines.seen)
