"""The SQLite and PostgreSQL stores build the same tables, columns and indexes; each difference is declared
here, with why."""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from tidepool.store.postgres import PostgresStore
from tidepool.store.sqlite import SqliteStore


@dataclass
class Shape:
    """What a store's schema is made of: columns by table, keys as (table, kind, columns), indexes by name."""

    columns: dict[str, list[str]]
    keys: set[tuple[str, str, tuple[str, ...]]]
    indexes: dict[str, tuple[str, tuple[str, ...]]]

    def but_declared(self) -> Shape:
        """This PostgreSQL shape without what only PostgreSQL is declared to have."""
        return Shape({t: [c for c in cols if (t, c) not in ONLY_POSTGRES_COLUMNS]
                      for t, cols in self.columns.items() if t not in ONLY_POSTGRES_TABLES},
                     {k for k in self.keys if k[0] not in ONLY_POSTGRES_TABLES},
                     {n: i for n, i in self.indexes.items() if n not in ONLY_POSTGRES_INDEXES})


ONLY_POSTGRES_TABLES = {
    "schema_version": "SQLite keeps the schema version in PRAGMA user_version",
}
ONLY_POSTGRES_COLUMNS = {
    ("tasks", "attempt_rows"): "claims of many nodes run at once: attempts are numbered under the task's row "
                               "lock; SQLite's one writer counts the task's attempts",
}
ONLY_POSTGRES_INDEXES = {
    name: "every node of a fleet runs the reconciler's passes on one database, each with an index of its own; "
          "one node writes a SQLite file, and tasks_leases and tasks_state serve them"
    for name in ("tasks_node_leases", "tasks_cancelling", "tasks_retry_due")
}

PG_COLUMNS = """
SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = $1
ORDER BY table_name, ordinal_position"""
PG_KEYS = """
SELECT tc.table_name, tc.constraint_type, array_agg(k.column_name::text ORDER BY k.ordinal_position)
FROM information_schema.table_constraints tc
JOIN information_schema.key_column_usage k USING (constraint_schema, constraint_name)
WHERE tc.table_schema = $1 AND tc.constraint_type IN ('PRIMARY KEY', 'UNIQUE')
GROUP BY tc.table_name, tc.constraint_name, tc.constraint_type"""
PG_INDEXES = """
SELECT i.relname, t.relname, array_agg(a.attname::text ORDER BY k.n)
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_namespace ns ON ns.oid = i.relnamespace
CROSS JOIN LATERAL unnest(x.indkey) WITH ORDINALITY AS k(attnum, n)
JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum
WHERE ns.nspname = $1 AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid)
GROUP BY i.relname, t.relname"""


async def sqlite_shape(path: Path) -> Shape:
    store = SqliteStore(path)
    await store.open()
    await store.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        info = {t: db.execute(f"PRAGMA table_info({t})").fetchall() for t in tables}
        keys = {(t, "PRIMARY KEY", tuple(r[1] for r in sorted(rows, key=lambda r: r[5]) if r[5]))
                for t, rows in info.items()}
        indexes: dict[str, tuple[str, tuple[str, ...]]] = {}
        unique: set[tuple[str, str, tuple[str, ...]]] = set()
        for name, table in db.execute("SELECT name, tbl_name FROM sqlite_master WHERE type = 'index'"):
            columns = tuple(r[2] for r in db.execute(f"PRAGMA index_info({name})"))
            if name.startswith("sqlite_autoindex_"):  # made for a PRIMARY KEY or UNIQUE column
                unique.add((table, "UNIQUE", columns))
            else:
                indexes[name] = (table, columns)
    keys |= {k for k in unique if (k[0], "PRIMARY KEY", k[2]) not in keys}
    return Shape({t: [r[1] for r in rows] for t, rows in info.items()}, keys, indexes)


async def postgres_shape(url: str, schema: str) -> Shape:
    store = PostgresStore(url, schema=schema)
    await store.open()
    await store.close()
    conn = await asyncpg.connect(url)
    try:
        columns: dict[str, list[str]] = {}
        for table, column in await conn.fetch(PG_COLUMNS, schema):
            columns.setdefault(table, []).append(column)
        keys = {(t, kind, tuple(cols)) for t, kind, cols in await conn.fetch(PG_KEYS, schema)}
        indexes = {name: (table, tuple(cols)) for name, table, cols in await conn.fetch(PG_INDEXES, schema)}
    finally:
        await conn.close()
    return Shape(columns, keys, indexes)


async def test_both_stores_build_the_same_schema_but_for_the_declared_differences(
        tmp_path: Path, postgres_schema: tuple[str, str]) -> None:
    lite = await sqlite_shape(tmp_path / "tidepool.db")
    pg = (await postgres_shape(*postgres_schema)).but_declared()
    assert lite.columns == pg.columns
    assert lite.keys == pg.keys
    assert lite.indexes == pg.indexes


async def test_every_declared_difference_is_still_there(tmp_path: Path, postgres_schema: tuple[str, str]) -> None:
    lite = await sqlite_shape(tmp_path / "tidepool.db")
    pg = await postgres_shape(*postgres_schema)
    for table in ONLY_POSTGRES_TABLES:
        assert table in pg.columns and table not in lite.columns
    for table, column in ONLY_POSTGRES_COLUMNS:
        assert column in pg.columns[table] and column not in lite.columns[table]
    for name in ONLY_POSTGRES_INDEXES:
        assert name in pg.indexes and name not in lite.indexes
