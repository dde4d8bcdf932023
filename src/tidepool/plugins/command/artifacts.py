"""A command's artifacts: the files its `artifacts` globs match in its work directory once it has run.

Each match is recorded by its base name, which must be a name an artifact may have; the globs are taken in
their order and each one's matches sorted, and a match whose name an earlier one took is left out. A match
must be a regular file inside the work directory when its links are followed: a command (of its own user,
say) cannot have the daemon record a file from elsewhere by leaving a link to it. Dot names are not matched
by `*` (glob's rule), and the runner's spool is never a match, even when a glob names it.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...model import file_name_error
from .output import SPOOL_DIR


@dataclass(frozen=True)
class Found:
    files: list[tuple[str, Path]]  # (artifact name, resolved path), in the order to record them
    refused: list[str]  # why each match left out was left out, a log line each


def find_artifacts(workdir: Path, globs: Sequence[str], *, taken: Sequence[str] = ()) -> Found:
    """The files `globs` match under `workdir`; `taken`: names recorded already (`stdout`). Blocking: run it
    in a worker thread."""
    root = workdir.resolve()
    names, files, refused = set(taken), [], []
    for pattern in globs:
        for relative in sorted(glob.glob(pattern, root_dir=root, recursive=True)):
            if (root / relative).is_dir():  # `out/*` matches its folders too: no file, and no news
                continue
            why = _refusal(root, relative, names)
            if why is not None:
                refused.append(f"{relative}: {why}")
                continue
            names.add(os.path.basename(relative))
            files.append((os.path.basename(relative), (root / relative).resolve()))
    return Found(files, refused)


def _refusal(root: Path, relative: str, names: set[str]) -> str | None:
    name = os.path.basename(relative)
    if Path(relative).parts[0] == SPOOL_DIR:
        return "the runner's own file, not the command's"
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        return "a link to a file outside the work directory"
    if not path.is_file():  # a pipe would hang the reader; a device, worse
        return "not a regular file"
    if (why := file_name_error(name)) is not None:
        return f"an artifact's name {why}"
    if name in names:
        return f"another file is the artifact {name!r} already"
    return None
