"""The disk a command's work directory uses, measured while the command runs.

A walk of the directory adds up the blocks each file holds (a sparse file counts what it really takes, a file
hard-linked twice counts once). It stays inside the directory and its file system: symbolic links are never
followed and mount points are not entered. The walk runs in a worker thread, and the next one starts no sooner
than nine times the last one took after it ended, so on a directory of very many files the watch costs at
most a tenth of one core's time, at the price of a coarser look. A file deleted while a process still holds
it open takes space no walk sees.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import anyio

_REST_PER_WALK = 9.0  # the pause after a walk, in units of what the walk took


def used_bytes(root: Path) -> int:
    """The bytes the files under `root` hold on disk. Blocking: run it in a worker thread."""
    device = os.lstat(root).st_dev
    seen: set[tuple[int, int]] = set()
    total, pending = 0, [str(root)]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:  # removed meanwhile, or not ours to read: what is gone takes no space
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_dev != device:
                continue
            if stat.S_ISDIR(info.st_mode):
                pending.append(entry.path)
            if info.st_nlink > 1 and not stat.S_ISDIR(info.st_mode):
                if (info.st_dev, info.st_ino) in seen:
                    continue
                seen.add((info.st_dev, info.st_ino))
            total += info.st_blocks * 512
    return total


class DiskWatch:
    """A command's work directory against its disk_mb: measured when due, off the event loop."""

    def __init__(self, workdir: Path, *, cap_mb: int, interval_s: float) -> None:
        self.workdir, self.cap_mb, self.interval_s = workdir, cap_mb, interval_s
        self.used = 0  # bytes, at the last walk
        self._due = 0.0  # monotonic

    async def over(self, *, now: float, force: bool = False) -> bool:
        """Whether the directory is past its cap, measured anew if a walk is due at `now` (monotonic), or
        `force`d."""
        if force or now >= self._due:
            started = time.monotonic()
            try:
                self.used = await anyio.to_thread.run_sync(used_bytes, self.workdir)
            except FileNotFoundError:  # nothing there, nothing used
                self.used = 0
            self._due = now + max(self.interval_s, (1 + _REST_PER_WALK) * (time.monotonic() - started))
        return self.used > self.cap_mb * 2**20
