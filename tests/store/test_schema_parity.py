"""The SQLite and PostgreSQL stores build one schema: the same tables, columns and indexes, unless a
difference is declared below with its reason. A table, column or index added to one adapter only fails
here until the other has it too, or the difference says why.

Constraint indexes (primary keys, UNIQUE columns) are left out: they come with the columns. An index is
compared by its table and columns; its predicate is written in each dialect's words.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import asyncpg
import pytest

from tidepool.store.postgres import PostgresStore
from tidepool.store.sqlite import SqliteStore
from tidepool.store.sqlite.database import Q as SQLITE_QUERIES

Schema = dict[str, str]  # "table t", "column t.c", "index i" -> what it is ("", or an index's table and columns)

# What one store has and the other has not, and why: (the store that has it, the item) -> the reason.
DECLARED: dict[tuple[str, str], str] = {
    ("postgres", "table schema_version"):
        "nodes starting together migrate under a lock and read the version as a row; a SQLite file keeps its "
        "version in PRAGMA user_version",
    ("postgres", "column tasks.attempt_rows"):
        "numbers a task's attempts under its row lock while claims of many nodes run at once; SQLite's one "
        "writer counts the attempt rows",
    ("postgres", "index tasks_node_leases"):
        "a node's start expires its earlier processes' leases among the leases of every node of the fleet; a "
        "SQLite file has one node, whose live leases tasks_state finds (state IN active)",
    ("postgres", "index tasks_cancelling"):
        "every node's reconciler looks for cancels past their deadline; in SQLite that pass reads the few "
        "cancelling rows through tasks_state",
    ("postgres", "index tasks_retry_due"):
        "every node's reconciler promotes the due retry_wait rows by available_at; SQLite's promote pass reads "
        "all retry_wait rows through tasks_state (without statistics it prefers that index to this one)",
}

# SQLite's statements for the passes PostgreSQL serves with an index of its own: each must still find its rows
# through an index, never by reading the whole table.
SQLITE_PASSES = ("expiring_of_node", "cancels_due", "promote_due")


async def test_both_stores_have_the_same_tables_columns_and_indexes_or_say_why_not(
        tmp_path: Path, postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    found = {"sqlite": await sqlite_schema(tmp_path / "tidepool.db"), "postgres": await postgres_schema_of(url, schema)}
    differences = {(store, item) for store, other in (("sqlite", "postgres"), ("postgres", "sqlite"))
                   for item in found[store].keys() - found[other].keys()}
    undeclared = sorted(d for d in differences if d not in DECLARED and not of_declared_table(*d))
    assert not undeclared, f"in one store only, and not declared in DECLARED with a reason: {undeclared}"
    stale = sorted(DECLARED.keys() - differences)
    assert not stale, f"declared as a difference, but both stores have it now (or neither): {stale}"
    shared = found["sqlite"].keys() & found["postgres"].keys()
    unlike = {item: (found["sqlite"][item], found["postgres"][item]) for item in sorted(shared)
              if found["sqlite"][item] != found["postgres"][item]}
    assert not unlike, f"the same index on other columns (sqlite, postgres): {unlike}"


@pytest.mark.parametrize("name", SQLITE_PASSES)
async def test_sqlite_finds_the_rows_of_each_pass_by_an_index(tmp_path: Path, name: str) -> None:
    """What the declared reasons above say of SQLite's plans (EXPLAIN QUERY PLAN on a fresh file)."""
    path = tmp_path / "tidepool.db"
    await sqlite_schema(path)
    sql = SQLITE_QUERIES[name]
    with sqlite3.connect(path) as conn:
        plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", (0,) * sql.count("?"))]
    assert plan and all(step.startswith("SEARCH tasks USING INDEX") for step in plan), plan


def of_declared_table(store: str, item: str) -> bool:
    """A column of a table that only `store` has: the table's declaration covers it."""
    kind, _, name = item.partition(" ")
    return kind == "column" and (store, f"table {name.split('.')[0]}") in DECLARED


async def sqlite_schema(path: Path) -> Schema:
    store = SqliteStore(path)
    await store.open()
    await store.close()
    with sqlite3.connect(path) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                             "AND name NOT LIKE 'sqlite_%'")]
        found: Schema = {f"table {t}": "" for t in tables}
        found |= {f"column {t}.{c[1]}": "" for t in tables for c in conn.execute(f"PRAGMA table_info({t})")}
        indexes = conn.execute("SELECT name, tbl_name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")
        for name, table in indexes.fetchall():
            columns = ", ".join(c[2] for c in conn.execute(f"PRAGMA index_info({name})"))
            found[f"index {name}"] = f"{table} ({columns})"
    return found


async def postgres_schema_of(url: str, schema: str) -> Schema:
    store = PostgresStore(url, schema=schema)
    await store.open()
    await store.close()
    conn = await asyncpg.connect(url)
    try:
        tables = [r[0] for r in await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = $1 AND table_type = 'BASE TABLE'",
            schema)]
        found: Schema = {f"table {t}": "" for t in tables}
        found |= {f"column {r[0]}.{r[1]}": "" for r in await conn.fetch(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = $1", schema)}
        found |= {f"index {r[0]}": f"{r[1]} ({', '.join(r[2])})" for r in await conn.fetch(INDEXES, schema)}
    finally:
        await conn.close()
    return found


INDEXES = """
SELECT i.relname, t.relname, ARRAY(
    SELECT a.attname FROM unnest(x.indkey) WITH ORDINALITY AS k(attnum, n)
    JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum ORDER BY k.n)
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_namespace s ON s.oid = t.relnamespace
WHERE s.nspname = $1 AND NOT x.indisprimary
  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid)"""
