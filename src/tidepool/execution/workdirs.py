"""Work directories: each attempt's own under this node's work root, and what an earlier process left there.

An attempt's directory is made by the plugin that wants it and removed by the attempt's stop phase,
whatever ended it. A process killed before its stop phases ran leaves its directories behind, and the
commands it ran in them: at start, before any attempt runs here, both are cleared, since no attempt owns
them any more.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import anyio

from ..plugins.command import kill_leftover_runs

log = logging.getLogger("tidepool.engine")  # the lines about leftovers keep the name operators filter on


def remove_workdir(path: str) -> None:
    """Remove one attempt's directory, if it is there (blocking: run it in a thread)."""
    shutil.rmtree(path, ignore_errors=True)


async def clear_leftovers(work_root: Path) -> None:
    """What an earlier process left under the work root. First the commands it left running: nothing watches
    them now, and beside their own retries they would use twice what exists once (a licence) and write into
    the directories. Then the work directories."""
    killed = await anyio.to_thread.run_sync(kill_leftover_runs, work_root)  # reads all of /proc
    if killed:
        log.warning("killed %d processes of commands left running by an earlier process", killed)
    cleared = await anyio.to_thread.run_sync(_remove_all, work_root)
    if cleared:
        log.info("cleared %d work directories left by an earlier process", cleared)


def _remove_all(work_root: Path) -> int:
    """Remove every directory under the work root; how many there were."""
    if not work_root.is_dir():
        return 0
    leftover = list(work_root.iterdir())
    for path in leftover:
        remove_workdir(str(path))
    return len(leftover)
