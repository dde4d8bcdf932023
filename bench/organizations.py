"""A claim filtered by organization against a deep queue of another organization's tasks.

One store of each dialect is filled with --tasks queued `default` tasks and, behind them in queue order,
10 `acme` tasks; then the claim's query runs --runs times per filter and its median time is printed:
unfiltered, `default` (the head matches), `acme` (its rows come last in queue order) and `nobody` (an
organization with no task). SQLite: the claim's SELECT on the file (what the writer thread runs, no lease
written). PostgreSQL: the schema's claim function in a transaction that is rolled back each time.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg

from tidepool.model import ClaimFilter
from tidepool.store.postgres import PostgresStore
from tidepool.store.sqlite import SqliteStore
from tidepool.store.sqlite.leases import claimable

FILTERS: dict[str, tuple[str, ...] | None] = {"any": None, "default": ("default",), "acme": ("acme",),
                                               "nobody": ("nobody",)}
INSERT = ("INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags, "
          "fingerprint, created_at, updated_at, available_at, organization) "
          "VALUES ({}, 'noop', '{{}}', 0, 'pending', 3, 60, {}, '', {}, {}, 0, {})")


def rows(n: int) -> list[tuple[str, float, str]]:
    return [(f"t{i:08d}", float(i), "default") for i in range(n)] + [(f"u{i:08d}", float(n + i), "acme")
                                                                    for i in range(10)]


def median_ms(run: object, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()  # type: ignore[operator]
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


async def sqlite_figures(n: int, runs: int) -> dict[str, float]:
    path = Path(tempfile.mkdtemp()) / "tidepool.db"
    store = SqliteStore(path)
    await store.open()
    await store.close()
    with sqlite3.connect(path) as conn:
        conn.executemany(INSERT.format("?", "'[]'", "?", "?", "?"), [(i, c, c, o) for i, c, o in rows(n)])
        conn.execute("ANALYZE")
    with sqlite3.connect(path) as conn:
        return {name: median_ms(lambda orgs=orgs: claimable(conn, ClaimFilter(organizations=orgs), 1, 1e12), runs)
                for name, orgs in FILTERS.items()}


async def postgres_figures(url: str, n: int, runs: int) -> dict[str, float]:
    schema = "bench_" + uuid.uuid4().hex
    store = PostgresStore(url, schema=schema)
    await store.open()
    await store.close()
    conn = await asyncpg.connect(url, server_settings={"search_path": schema})
    try:
        await conn.executemany(INSERT.format("$1", "'{}'", "$2", "$2", "$3"), rows(n))
        await conn.execute("ANALYZE tasks")
        figures = {}
        for name, orgs in FILTERS.items():
            times = []
            for _ in range(runs):
                tx = conn.transaction()
                await tx.start()
                start = time.perf_counter()
                await conn.fetch("SELECT * FROM claim(1e12, 1, '{a}', '{t}', '{n}', '{i}', '{w}', '{0}', '{1}', "
                                 "NULL, NULL, $1)", None if orgs is None else list(orgs))
                times.append((time.perf_counter() - start) * 1000)
                await tx.rollback()
            figures[name] = statistics.median(times)
        return figures
    finally:
        await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test", help="'' to leave it out")
    args = parser.parse_args()
    results = {"sqlite": await sqlite_figures(args.tasks, args.runs)}
    if args.postgres:
        results["postgres"] = await postgres_figures(args.postgres, args.tasks, args.runs)
    print(f"claim of 1 with {args.tasks:,} default tasks queued, median of {args.runs} (ms)", file=sys.stderr)
    for store, figures in results.items():
        print(f"{store:9}" + "".join(f"  {name} {ms:8.3f}" for name, ms in figures.items()))


if __name__ == "__main__":
    asyncio.run(main())
