"""SQL kept in .sql files in the `sql/` folder of the adapter that runs it: numbered migrations and named
queries, under the same file names in both dialects.

A migration is `NNN_what.sql`; its number is the schema version it brings the store to, so the order is
the files' and a gap is an error. A query file holds sections, each opened by a `-- name: X` line. A query
may name what both adapters share, filled in when the file is loaded: the state sets of `rules` as
`{queued}`, `{active}`, `{working}`, `{terminal}`, `{unfinished}`, and the column lists of `rows` as
`{task_columns}`, `{attempt_columns}`, `{result_columns}`, `{artifact_columns}`, `{schedule_columns}`, `{node_columns}`,
`{worker_columns}` and `{scan_columns}`. Any other text stays as it is: a `{marks}` for the adapter to
fill per call (a list of `?` marks, say), or braces of PostgreSQL's own.
"""

from __future__ import annotations

import re
from importlib import resources

from . import rows, rules

SHARED = {"queued": rules.QUEUED_SQL, "active": rules.ACTIVE_SQL, "working": rules.WORKING_SQL,
          "terminal": rules.TERMINAL_SQL, "unfinished": rules.UNFINISHED_SQL, "task_columns": rows.TASK_COLUMNS,
          "attempt_columns": rows.ATTEMPT_COLUMNS, "result_columns": rows.RESULT_COLUMNS,
          "schedule_columns": rows.SCHEDULE_COLUMNS,
          "artifact_columns": rows.ARTIFACT_COLUMNS, "node_columns": rows.NODE_COLUMNS,
          "worker_columns": rows.WORKER_COLUMNS, "scan_columns": rows.SCAN_COLUMNS}
NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
SHARED_NAME = re.compile(r"\{(" + "|".join(SHARED) + r")\}")
MIGRATION = re.compile(r"^(\d{3})_\w+\.sql$")


def queries(package: str, file: str) -> dict[str, str]:
    """The named sections of `package`'s sql/`file`, by name, what both adapters share filled in."""
    parts = NAME.split(resources.files(package).joinpath("sql", file).read_text(encoding="utf-8"))
    named = dict(zip(parts[1::2], parts[2::2], strict=True))
    if len(named) != len(parts) // 2:
        raise RuntimeError(f"{package}/{file}: a query name is used twice")
    return {name: SHARED_NAME.sub(lambda m: SHARED[m.group(1)], text.strip()) for name, text in named.items()}


def migrations(package: str) -> list[tuple[int, str]]:
    """The migration scripts in `package`'s sql/ as (the version each brings the schema to, its text), in order."""
    found: dict[int, str] = {}
    for entry in resources.files(package).joinpath("sql").iterdir():
        if m := MIGRATION.match(entry.name):
            if int(m.group(1)) in found:
                raise RuntimeError(f"{package}: two migrations are numbered {m.group(1)}")
            found[int(m.group(1))] = entry.read_text(encoding="utf-8")
    versions = sorted(found)
    if versions != list(range(1, len(versions) + 1)):
        raise RuntimeError(f"{package}: migrations must be numbered 001, 002, ... without a gap: found {versions}")
    return [(v, found[v]) for v in versions]
