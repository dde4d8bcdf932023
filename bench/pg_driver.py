"""Driver comparison for the PostgreSQL store: asyncpg against psycopg 3 (async), on this machine.

Two shapes of the store's hot path, each on a fresh table in a throwaway schema:
  (a) claim 32 with FOR UPDATE SKIP LOCKED and complete those 32 in one grouped UPDATE, one transaction;
  (b) single-row fenced UPDATEs (a renewal), one autocommit round trip each.
Each runs twice: as deployed (every commit waits for its WAL flush), and with the session's
synchronous_commit off, which leaves the cost of driver and protocol alone: the WAL flush of this
shared virtual disk varies with whatever else the machine is doing. Prints the median of 3 runs per
driver (interleaved) and the asyncpg/psycopg ratio. Both drivers use prepared statements (asyncpg
always; psycopg with prepare=True) and one connection each, as a pooled worker would.

    .venv/bin/python bench/pg_driver.py [--url postgresql://postgres@127.0.0.1:5432/test] [--uvloop]

The virtual disk here acknowledges fsync in ~0.1-1 ms, faster than most real disks: on real hardware
(b) is bound by the WAL flush and the drivers converge; (a) shares one flush among 32 tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import psycopg

BATCH = 32
ROUNDS_A = 150  # transactions of 32 claims + 32 completions per run
ROUNDS_B = 3000  # fenced single-row updates per run
RUNS = 3

DDL = """
CREATE TABLE {s}.tasks (
    id text PRIMARY KEY, state text NOT NULL, priority int NOT NULL, created_at float8 NOT NULL,
    available_at float8 NOT NULL, attempt int NOT NULL DEFAULT 0, max_attempts int NOT NULL DEFAULT 3,
    lease_attempt_id text, lease_token text, lease_expires_at float8, updated_at float8, finished_at float8
);
CREATE INDEX tasks_queue ON {s}.tasks (priority DESC, created_at, id) WHERE state IN ('pending', 'retry_wait');
"""
CLAIM = """
WITH picked AS (
    SELECT id FROM {s}.tasks WHERE state IN ('pending', 'retry_wait') AND available_at <= $1
      AND attempt < max_attempts ORDER BY priority DESC, created_at, id LIMIT $2 FOR UPDATE SKIP LOCKED)
UPDATE {s}.tasks t SET state = 'leased', attempt = t.attempt + 1, updated_at = $1,
       lease_attempt_id = md5(random()::text), lease_token = md5(random()::text), lease_expires_at = $1 + 30
FROM picked WHERE t.id = picked.id RETURNING t.id, t.lease_attempt_id, t.lease_token
"""
COMPLETE = """
UPDATE {s}.tasks t SET state = 'completed', updated_at = $1, finished_at = $1, lease_token = NULL
FROM unnest($2::text[], $3::text[], $4::text[]) AS l(id, attempt_id, token)
WHERE t.id = l.id AND t.lease_attempt_id = l.attempt_id AND t.lease_token = l.token
  AND t.state IN ('leased', 'running') AND t.lease_expires_at > $1
RETURNING t.id
"""
RENEW = """
UPDATE {s}.tasks SET lease_expires_at = $5 + 30 WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3
  AND state IN ('leased', 'running') AND lease_expires_at > $4
"""


def _pg(sql: str) -> str:
    """asyncpg's $n placeholders in psycopg's %s style (every statement here uses them in order)."""
    for n in range(9, 0, -1):
        sql = sql.replace(f"${n}", f"%(p{n})s")
    return sql


def _settings(flush: bool) -> dict[str, str]:
    # The store's claim runs with sorting off (the queue index gives the order) and without JIT.
    return {"synchronous_commit": "on" if flush else "off", "enable_sort": "off", "jit": "off"}


def _commit_option(flush: bool) -> str:
    return " ".join(f"-c {k}={v}" for k, v in _settings(flush).items())


def _params(*args: Any) -> dict[str, Any]:
    return {f"p{i}": a for i, a in enumerate(args, 1)}


async def _setup(url: str, schema: str, rows: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; {DDL.format(s=schema)}")
        now = time.time()
        await conn.executemany(
            f"INSERT INTO {schema}.tasks (id, state, priority, created_at, available_at) "
            "VALUES ($1, 'pending', 0, $2, $2)",
            [(f"{i:012d}", now + i * 1e-6) for i in range(rows)],
        )
        await conn.execute(f"VACUUM ANALYZE {schema}.tasks")
        if rows == 1:  # (b) renews one leased row forever
            await conn.execute(
                f"UPDATE {schema}.tasks SET state = 'leased', lease_attempt_id = 'a', "
                "lease_token = 't', lease_expires_at = $1",
                now + 3600,
            )
    finally:
        await conn.close()


async def _drop(url: str, schema: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    finally:
        await conn.close()


# (a) claim 32 + complete 32 per transaction


async def _claim_asyncpg(url: str, s: str, flush: bool) -> int:
    conn = await asyncpg.connect(url, server_settings=_settings(flush))
    done = 0
    try:
        claim, complete = await conn.prepare(CLAIM.format(s=s)), await conn.prepare(COMPLETE.format(s=s))
        for _ in range(ROUNDS_A):
            now = time.time()
            async with conn.transaction():
                rows = await claim.fetch(now, BATCH)
                ids, attempts, tokens = zip(*rows, strict=True) if rows else ((), (), ())
                done += len(await complete.fetch(now, list(ids), list(attempts), list(tokens)))
    finally:
        await conn.close()
    return done


async def _claim_psycopg(url: str, s: str, flush: bool) -> int:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True, options=_commit_option(flush))
    done = 0
    try:
        claim, complete = _pg(CLAIM.format(s=s)), _pg(COMPLETE.format(s=s))
        for _ in range(ROUNDS_A):
            now = time.time()
            async with conn.transaction():
                cur = await conn.execute(claim, _params(now, BATCH), prepare=True)
                rows = await cur.fetchall()
                ids, attempts, tokens = zip(*rows, strict=True) if rows else ((), (), ())
                cur = await conn.execute(complete, _params(now, list(ids), list(attempts), list(tokens)), prepare=True)
                done += len(await cur.fetchall())
    finally:
        await conn.close()
    return done


# (b) single-row fenced updates


async def _renew_asyncpg(url: str, s: str, flush: bool) -> int:
    conn = await asyncpg.connect(url, server_settings=_settings(flush))
    try:
        renew = await conn.prepare(RENEW.format(s=s))
        for _ in range(ROUNDS_B):
            now = time.time()
            await renew.fetch("000000000000", "a", "t", now, now)
    finally:
        await conn.close()
    return ROUNDS_B


async def _renew_psycopg(url: str, s: str, flush: bool) -> int:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True, options=_commit_option(flush))
    try:
        renew = _pg(RENEW.format(s=s))
        for _ in range(ROUNDS_B):
            now = time.time()
            await conn.execute(renew, _params("000000000000", "a", "t", now, now), prepare=True)
    finally:
        await conn.close()
    return ROUNDS_B


async def _measure(url: str, rows: int, run: Callable[[str, str, bool], Awaitable[int]], flush: bool) -> float:
    schema = f"bench_pgdriver_{uuid.uuid4().hex[:8]}"
    await _setup(url, schema, rows)
    try:
        started = time.perf_counter()
        n = await run(url, schema, flush)
        return n / (time.perf_counter() - started)
    finally:
        await _drop(url, schema)


async def main(url: str) -> None:
    shapes = [
        (
            f"(a) claim {BATCH} + complete {BATCH} per transaction",
            "tasks/s",
            BATCH * ROUNDS_A,
            _claim_asyncpg,
            _claim_psycopg,
        ),
        ("(b) fenced single-row UPDATE, autocommit", "round trips/s", 1, _renew_asyncpg, _renew_psycopg),
    ]
    print(f"PostgreSQL driver comparison, median of {RUNS} runs, loop {type(asyncio.get_running_loop()).__module__}")
    for (title, unit, rows, with_asyncpg, with_psycopg), flush in [(s, f) for f in (True, False) for s in shapes]:
        title += "" if flush else ", synchronous_commit off"
        a: list[float] = []
        p: list[float] = []
        for run in range(RUNS):  # interleaved, each going first in turn, so a load spike hits both alike
            pair = [(a, with_asyncpg), (p, with_psycopg)]
            for figures, shape in pair if run % 2 == 0 else pair[::-1]:
                figures.append(await _measure(url, rows, shape, flush))
        ma, mp = statistics.median(a), statistics.median(p)
        print(
            f"{title}\n  asyncpg {asyncpg.__version__}: {ma:10,.0f} {unit}"
            f"\n  psycopg {psycopg.__version__}: {mp:10,.0f} {unit}\n  ratio asyncpg/psycopg: {ma / mp:.2f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--url", default=os.environ.get("TIDEPOOL_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")
    )
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop, as the daemon does when installed")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.run(main(args.url))
    else:
        asyncio.run(main(args.url))
