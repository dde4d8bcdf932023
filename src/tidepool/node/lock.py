"""The node lock: one daemon per node id and SQLite file, and per node id and state directory.

A start clears its work root, killing the commands an earlier daemon left running there; those must
never be a running daemon's, whatever its store. So a daemon holds a lock file beside its work root
and, on SQLite, one beside the database file, for as long as it runs. PostgreSQL fences a node id
across hosts in the store itself (`Store.lock_node`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ..errors import ConfigError


def file_safe(node_id: str) -> str:
    """A node id as part of a file name (node ids are free text)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", node_id)


@contextlib.contextmanager
def node_lock(node_id: str, *, work_root: Path, db_path: Path | None) -> Iterator[None]:
    """Hold the node's locks until the block ends; ConfigError naming the other daemon when one holds them."""
    with contextlib.ExitStack() as locks:
        if db_path is not None:
            db_path.parent.mkdir(parents=True, exist_ok=True)
            db = db_path.resolve()  # one file reached through a symlink is still one database: one lock
            locks.enter_context(_locked(db.with_name(f"{db.name}.{file_safe(node_id)}.lock"),
                                        f"node {node_id} already runs on {db}"))
        work_root.parent.mkdir(parents=True, exist_ok=True)
        locks.enter_context(_locked(work_root.with_name(f"{work_root.name}.lock"),
                                    f"node {node_id} already runs with work directories in {work_root}"))
        yield


@contextlib.contextmanager
def _locked(path: Path, held: str) -> Iterator[None]:
    """Hold an exclusive lock on `path` (with our pid in it); ConfigError saying `held` when another has it."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            other = handle.read().strip() or "unknown"
            raise ConfigError(f"{held} (pid {other}, lock {path}); stop it or give this daemon another "
                              "node.id") from None
        handle.truncate(0)
        handle.write(str(os.getpid()))
        handle.flush()
        yield
