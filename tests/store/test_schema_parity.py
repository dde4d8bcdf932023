"""The SQLite and PostgreSQL stores build one schema: the same tables, columns (in the same order), keys
and indexes, unless a difference is declared below with its reason. A table, column, key or index added
to one adapter only fails here until the other has it too, or the difference says why.

Keys are primary keys and UNIQUE columns. An index is compared by its table and columns; its predicate
is written in each dialect's words.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import asyncpg
import pytest

from tidepool.model import ClaimFilter
from tidepool.store.postgres import PostgresStore
from tidepool.store.sqlite import SqliteStore
from tidepool.store.sqlite.leases import claimable
from tidepool.store.sqlite.upkeep import Q as SQLITE_QUERIES

# "table t" -> its columns in order; "column t.c", "key t KIND (columns)" -> ""; "index i" -> its table and columns
Schema = dict[str, str]

# What one store has and the other has not, and why: (the store that has it, the item) -> the reason.
DECLARED: dict[tuple[str, str], str] = {
    ("postgres", "table blob_chunks"):
        "blobs' bytes live in the database, so every node and gateway of a fleet serves them; a SQLite store keeps "
        "them in files beside the database",
    ("postgres", "table schema_version"):
        "nodes starting together migrate under a lock and read the version as a row; a SQLite file keeps its "
        "version in PRAGMA user_version",
    ("postgres", "column tasks.attempt_rows"):
        "numbers a task's attempts under its row lock while claims of many nodes run at once; SQLite's one "
        "writer counts the attempt rows",
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


async def test_both_stores_have_the_same_tables_columns_keys_and_indexes_or_say_why_not(
        tmp_path: Path, postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    found = {"sqlite": await sqlite_schema(tmp_path / "tidepool.db"), "postgres": await postgres_schema_of(url, schema)}
    differences = {(store, item) for store, other in (("sqlite", "postgres"), ("postgres", "sqlite"))
                   for item in found[store].keys() - found[other].keys()}
    undeclared = sorted(d for d in differences if d not in DECLARED and not of_declared_table(*d))
    assert not undeclared, f"in one store only, and not declared in DECLARED with a reason: {undeclared}"
    stale = sorted(DECLARED.keys() - differences)
    assert not stale, f"declared as a difference, but both stores have it now (or neither): {stale}"
    unlike = {item: (lite, pg) for item in sorted(found["sqlite"].keys() & found["postgres"].keys())
              for lite, pg in [alike(found["sqlite"][item], found["postgres"][item])] if lite != pg}
    assert not unlike, f"a table's columns in another order, or an index on other columns (sqlite, postgres): {unlike}"


def alike(lite: str, pg: str) -> tuple[list[str], list[str]]:
    """Two descriptions of one item as lists to compare; of a table's columns, those both stores have."""
    a, b = lite.split(", "), pg.split(", ")
    return [x for x in a if x in b], [x for x in b if x in a]


@pytest.mark.parametrize("name", SQLITE_PASSES)
async def test_sqlite_finds_the_rows_of_each_pass_by_an_index(tmp_path: Path, name: str) -> None:
    """What the declared reasons above say of SQLite's plans (EXPLAIN QUERY PLAN on a fresh file)."""
    path = tmp_path / "tidepool.db"
    await sqlite_schema(path)
    sql = SQLITE_QUERIES[name]
    with sqlite3.connect(path) as conn:
        plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", (0,) * sql.count("?"))]
    assert plan and all(step.startswith("SEARCH tasks USING INDEX") for step in plan), plan


async def test_sqlite_reads_a_claim_for_organizations_from_each_ones_queue_index(tmp_path: Path) -> None:
    """A remote worker's claim never reads the whole queue (whose head may be another organization's)."""
    path = tmp_path / "tidepool.db"
    await sqlite_schema(path)
    statements: list[str] = []
    with sqlite3.connect(path) as conn:
        conn.set_trace_callback(statements.append)
        claimable(conn, ClaimFilter(tag_sets=(frozenset({"lan"}),), organizations=("acme", "globex")), 5, 0.0,
                  ("scan.*",))
        conn.set_trace_callback(None)
        plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {statements[-1]}")]
    reads = [step for step in plan if " tasks " in f"{step} "]
    assert len(reads) == 2 and all(
        step.startswith("SEARCH tasks USING INDEX tasks_organization_queue (organization=?") for step in reads), plan


def of_declared_table(store: str, item: str) -> bool:
    """A column or key of a table that only `store` has: the table's declaration covers it."""
    kind, _, rest = item.partition(" ")
    table = rest.split(".")[0] if kind == "column" else rest.split(" ")[0]
    return kind in ("column", "key") and (store, f"table {table}") in DECLARED


async def sqlite_schema(path: Path) -> Schema:
    store = SqliteStore(path)
    await store.open()
    await store.close()
    with sqlite3.connect(path) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                             "AND name NOT LIKE 'sqlite_%'")]
        info = {t: conn.execute(f"PRAGMA table_info({t})").fetchall() for t in tables}
        found: Schema = {f"table {t}": ", ".join(c[1] for c in rows) for t, rows in info.items()}
        found |= {f"column {t}.{c[1]}": "" for t, rows in info.items() for c in rows}
        found |= {f"key {t} PRIMARY KEY ({', '.join(c[1] for c in sorted(rows, key=lambda c: c[5]) if c[5])})": ""
                  for t, rows in info.items()}
        for name, table, sql in conn.execute("SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'index'"):
            columns = ", ".join(c[2] for c in conn.execute(f"PRAGMA index_info({name})"))
            if sql is not None:
                found[f"index {name}"] = f"{table} ({columns})"
            elif f"key {table} PRIMARY KEY ({columns})" not in found:  # SQLite's own index of a UNIQUE column
                found[f"key {table} UNIQUE ({columns})"] = ""
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
        columns = await conn.fetch("SELECT table_name, column_name FROM information_schema.columns "
                                   "WHERE table_schema = $1 ORDER BY table_name, ordinal_position", schema)
        found: Schema = {f"table {t}": ", ".join(c for table, c in columns if table == t) for t in tables}
        found |= {f"column {t}.{c}": "" for t, c in columns}
        found |= {f"key {r[0]} {r[1]} ({', '.join(r[2])})": "" for r in await conn.fetch(KEYS, schema)}
        found |= {f"index {r[0]}": f"{r[1]} ({', '.join(r[2])})" for r in await conn.fetch(INDEXES, schema)}
    finally:
        await conn.close()
    return found


KEYS = """
SELECT c.table_name, c.constraint_type, array_agg(k.column_name::text ORDER BY k.ordinal_position)
FROM information_schema.table_constraints c
JOIN information_schema.key_column_usage k USING (constraint_schema, constraint_name)
WHERE c.table_schema = $1 AND c.constraint_type IN ('PRIMARY KEY', 'UNIQUE')
GROUP BY c.table_name, c.constraint_name, c.constraint_type"""
INDEXES = """
SELECT i.relname, t.relname, ARRAY(
    SELECT a.attname FROM unnest(x.indkey) WITH ORDINALITY AS k(attnum, n)
    JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum ORDER BY k.n)
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_namespace s ON s.oid = t.relnamespace
WHERE s.nspname = $1 AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid)"""
