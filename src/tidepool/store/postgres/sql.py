"""The statements of the PostgreSQL store, read from the .sql files beside this module.

A file holds statements each under a `-- name: NAME` line; a numbered file (001_tasks.sql) is one
migration, run whole.
"""

from __future__ import annotations

import re
from importlib.resources import files

NAME = re.compile(r"^-- name: (\w+)[ \t]*$", re.MULTILINE)
MIGRATION = re.compile(r"(\d{3})_\w+\.sql")


def text(filename: str) -> str:
    return files(__package__).joinpath(filename).read_text(encoding="utf-8")


def named(*filenames: str) -> dict[str, str]:
    """Every named statement of the files; a name used twice is a mistake, refused at import."""
    found: dict[str, str] = {}
    for filename in filenames:
        parts = NAME.split(text(filename))
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in found:
                raise ValueError(f"{filename}: statement {name!r} is named twice")
            found[name] = body.strip()
    return found


def migrations() -> dict[int, str]:
    """The numbered migrations by version."""
    return {int(m[1]): text(m[0]) for f in files(__package__).iterdir() if (m := MIGRATION.fullmatch(f.name))}


SQL = named("tasks.sql", "leases.sql", "reconciler.sql", "fleet.sql")
