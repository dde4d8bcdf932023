"""What a command said: the head of its stdout and the tail of its stderr, kept within bounds as it runs."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import anyio

_STDERR_TAIL = 4096


@dataclass(frozen=True)
class CommandResult:
    exit_status: int  # negative: killed by that signal
    stdout: bytes  # at most max_output_kb KiB
    stdout_dropped: int
    stderr_tail: str  # the last 4 KiB
    stderr_dropped: int

    def result_payload(self) -> object:
        """stdout parsed as JSON if it is strict JSON, else {"text": stdout}."""
        try:
            value = json.loads(self.stdout)
            # Python's parser takes what no store or client could take back: NaN, 1e999 (inf), a lone
            # surrogate (not UTF-8). Storing it the way the store will is the one test that sees them all.
            json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeError; RecursionError: deep nesting
            return {"text": self.stdout.decode(errors="replace")}
        return value


class Capture(asyncio.SubprocessProtocol):
    """Keeps the head of stdout and the tail of stderr, however much the child writes."""

    def __init__(self, *, stdout_cap: int) -> None:
        self.stdout_cap = stdout_cap
        self.stdout = bytearray()
        self.stdout_dropped = 0
        self.stderr = bytearray()
        self.stderr_dropped = 0
        self.exited = False
        self.wake = anyio.Event()  # the child exited or stdout overflowed
        self.closed = anyio.Event()  # the child exited and both pipes are at their end

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        # Everything is read as it arrives, so the child never blocks on a full pipe.
        if fd == 1:
            room = max(self.stdout_cap - len(self.stdout), 0)
            self.stdout += data[:room]
            if len(data) > room:
                self.stdout_dropped += len(data) - room
                self.wake.set()
        else:
            self.stderr_dropped += max(len(data) - _STDERR_TAIL, 0)
            self.stderr += data[-_STDERR_TAIL:]
            excess = len(self.stderr) - _STDERR_TAIL
            if excess > 0:
                del self.stderr[:excess]
                self.stderr_dropped += excess

    def process_exited(self) -> None:
        self.exited = True
        self.wake.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    def result(self, exit_status: int) -> CommandResult:
        return CommandResult(
            exit_status=exit_status,
            stdout=bytes(self.stdout),
            stdout_dropped=self.stdout_dropped,
            stderr_tail=self.stderr.decode(errors="replace"),
            stderr_dropped=self.stderr_dropped,
        )
