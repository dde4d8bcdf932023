"""What a command said: its whole stdout spooled to a file of its work directory, the head of it for the result,
and the tail of its stderr, kept within bounds as it runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import anyio

_STDERR_TAIL = 4096
# Under the work directory, so that disk_mb counts it like any file the command writes; a dot name, which the
# artifacts globs never match (see artifacts.py).
SPOOL_DIR = ".tidepool"


@dataclass(frozen=True)
class CommandResult:
    exit_status: int  # negative: killed by that signal
    stdout: bytes  # the first max_output_kb KiB
    stdout_dropped: int  # stdout's bytes past those: the whole of it is in stdout_file
    stderr_tail: str  # the last 4 KiB
    stderr_dropped: int
    stdout_file: Path | None = None  # all of stdout, in the work directory

    def result_payload(self) -> object:
        """stdout parsed as JSON if it is strict JSON, else {"text": stdout}; the head of a stdout past
        max_output_kb is text, marked truncated (its whole is the artifact `stdout`)."""
        if self.stdout_dropped:
            return {"text": self.stdout.decode(errors="replace"), "truncated": True,
                    "stdout_bytes": len(self.stdout) + self.stdout_dropped}
        try:
            value = json.loads(self.stdout)
            # Python's parser takes what no store or client could take back: NaN, 1e999 (inf), a lone
            # surrogate (not UTF-8). Storing it the way the store will is the one test that sees them all.
            json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeError; RecursionError: deep nesting
            return {"text": self.stdout.decode(errors="replace")}
        return value


class StdoutSpool:
    """The file a command's stdout goes to, whole: the child writes it directly (no pipe through the event
    loop), the supervisor watches its size, and the result reads its head.

    A command of its own user owns the work directory and may have left a link where the spool goes (a
    second command of the attempt): the directory is opened without following links and the file is made
    anew in it, so the daemon writes nowhere else. Blocking but brief (a mkdir, an open)."""

    def __init__(self, workdir: Path) -> None:
        directory = workdir / SPOOL_DIR
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink("stdout", dir_fd=dir_fd)
            self.fd = os.open("stdout", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        self.path = directory / "stdout"

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    async def head(self, limit: int) -> bytes:
        """The first `limit` bytes (read in a worker thread: up to max_output_kb)."""
        return await anyio.to_thread.run_sync(os.pread, self.fd, limit, 0)

    def close(self) -> None:
        os.close(self.fd)


class Capture(asyncio.SubprocessProtocol):
    """Keeps the tail of stderr, however much the child writes (its stdout goes to a StdoutSpool)."""

    def __init__(self) -> None:
        self.stderr = bytearray()
        self.stderr_dropped = 0
        self.exited = False
        self.wake = anyio.Event()  # the child exited
        self.closed = anyio.Event()  # the child exited and its pipes are at their end

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        # Everything is read as it arrives, so the child never blocks on a full pipe.
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

    async def result(self, exit_status: int, spool: StdoutSpool, *, stdout_cap: int) -> CommandResult:
        size = spool.size()
        head = await spool.head(min(size, stdout_cap))
        return CommandResult(
            exit_status=exit_status,
            stdout=head,
            stdout_dropped=size - len(head),
            stderr_tail=self.stderr.decode(errors="replace"),
            stderr_dropped=self.stderr_dropped,
            stdout_file=spool.path,
        )
