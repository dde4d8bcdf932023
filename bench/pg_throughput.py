"""PostgreSQL fleet: drain rate of 1, 2 and 3 nodes on one database, double claims, cross-node pickup latency.

Every part runs on a fresh schema of the server at --url (dropped afterwards), with real daemons
(`tidepool run` subprocesses, pool.min_workers = max_workers = --workers, claim_batch --claim-batch):
  drain    N nodes start on an empty queue; --n noop tasks go in with one add_many (one NOTIFY wakes
           every node); rate = n / (first attempt started .. last task finished), as the store recorded
           them, every completion committed. Double claims: tasks with more than one attempt (no lease
           can expire in a run this short, so any is a task two workers held) - must be 0.
  ceiling  no daemon: PostgresStore driven by --workers concurrent claim+finish loops in this process
           on the same n tasks; what the pool, engine, leases and HTTP-free daemon overhead cost.
  pickup   node A accepts no task type (pool.task_types = ["nothing"]), node B everything; --pickups
           single submits to A's API, one at a time; latency = B's attempt started_at - created_at.
Figures only (median of --runs); never pass/fail. Two cores here are shared by the nodes and the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg

from _harness import (
    Daemon,
    Figure,
    arguments,
    claim_finish_rate,
    fsync_note,
    median,
    percentile,
    report,
    reproduce,
    spread,
    temp_dir,
)

DEFAULTS: dict[str, Any] = {"n": 20_000, "workers": 32, "claim_batch": 16, "runs": 3, "pickups": 200,
                            "url": "postgresql://postgres@127.0.0.1:5432/test"}


@contextlib.contextmanager
def schema(url: str) -> Iterator[str]:
    name = "bench_" + uuid.uuid4().hex[:12]
    try:
        yield name
    finally:
        fetch(url, name, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def fetch(url: str, schema_name: str, sql: str, *args: Any) -> list[Any]:
    async def go() -> list[Any]:
        conn = await asyncpg.connect(url, server_settings={"search_path": f'"{schema_name}"'})
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    return asyncio.run(go())


def enqueue(url: str, schema_name: str, n: int) -> None:
    """n noop tasks in one transaction, straight into the store (the daemons are not what is measured here)."""
    from tidepool.model import NewTask
    from tidepool.store.postgres import PostgresStore

    async def go() -> None:
        store = PostgresStore(url, schema=schema_name)
        await store.open()
        try:
            await store.add_many([NewTask("noop")] * n, now=time.time())
        finally:
            await store.close()

    asyncio.run(go())


def start_nodes(tmp: Path, url: str, schema_name: str, names: list[str], pool: dict[str, Any]) -> list[Daemon]:
    daemons = [Daemon(tmp / name, overrides={"node": {"id": name}, "store": {"url": f"{url}?schema={schema_name}"},
                                             "pool": pool, "lease": {"duration_s": 60.0, "renew_every_s": 20.0}})
               for name in names]
    for d in daemons:  # one after another: the first creates the schema, the others find it
        d.start(timeout_s=60)
    return daemons


def drain(tmp: Path, url: str, n: int, nodes: int, workers: int, claim_batch: int) -> tuple[float, int]:
    """(tasks/s from first claim to last finish as stored, tasks with more than one attempt)."""
    with schema(url) as s:
        pool = {"min_workers": workers, "max_workers": workers, "claim_batch": claim_batch, "poll_interval_s": 2.0}
        daemons = start_nodes(tmp, url, s, [f"node-{k}" for k in range(nodes)], pool)
        try:
            enqueue(url, s, n)
            deadline = time.monotonic() + 300
            while fetch(url, s, "SELECT count(*) FROM tasks WHERE state <> 'completed'")[0][0]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{nodes} nodes did not drain {n} tasks in 300 s")
                time.sleep(0.05)
        finally:
            for d in daemons:
                d.stop()
        (first, last, done), = fetch(url, s, "SELECT (SELECT min(started_at) FROM attempts), max(finished_at), "
                                              "count(*) FROM tasks WHERE state = 'completed'")
        (double,), = fetch(url, s, "SELECT count(*) FROM (SELECT task_id FROM attempts GROUP BY task_id "
                                   "HAVING count(*) > 1) AS twice")
        if done != n:
            raise RuntimeError(f"drain: {done} of {n} tasks completed")
        return n / (last - first), int(double)


def ceiling(url: str, n: int, workers: int, claim_batch: int) -> float:
    """Tasks/s of `workers` concurrent claim+finish loops on PostgresStore itself (uvloop, like the daemon)."""
    import anyio

    from tidepool.store.postgres import PostgresStore

    with schema(url) as s:
        enqueue(url, s, n)

        async def main() -> float:
            store = PostgresStore(url, schema=s)
            await store.open()
            try:
                return await claim_finish_rate(store, n, workers, claim_batch, lease_s=60.0)
            finally:
                await store.close()

        rate: float = anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
        return rate


def pickup(tmp: Path, url: str, count: int) -> list[float]:
    """Seconds from a submit on node A to the start of its attempt on node B, one task at a time."""
    with schema(url) as s:
        (a,) = start_nodes(tmp, url, s, ["node-a"], {"task_types": ["nothing"], "min_workers": 2})
        (b,) = start_nodes(tmp, url, s, ["node-b"], {"min_workers": 4, "max_workers": 4, "poll_interval_s": 5.0})
        try:
            for _ in range(count):
                task_id = a.post("/v1/tasks", {"type": "noop"})["id"]
                deadline = time.monotonic() + 10
                while b.get(f"/v1/tasks/{task_id}")["state"] != "completed":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"task {task_id} not done within 10 s")
                    time.sleep(0.002)
                time.sleep(0.01)
        finally:
            a.stop()
            b.stop()
        rows = fetch(url, s, "SELECT a.started_at - t.created_at, a.node_id FROM tasks t "
                             "JOIN attempts a ON a.task_id = t.id")
        if {r[1] for r in rows} != {"node-b"}:
            raise RuntimeError("pickup: a task ran on the node that accepts nothing")
        return sorted(r[0] for r in rows)


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    n, w, cb, url = args.n, args.workers, args.claim_batch, args.url
    rates: dict[str, list[float]] = {k: [] for k in ("node1", "node1_cb1", "node2", "node3", "ceil", "ceil1")}
    doubles = 0
    p50: list[float] = []
    p99: list[float] = []
    for run in range(args.runs):
        with temp_dir("pg") as tmp:
            for nodes in (1, 2, 3):
                rate, double = drain(tmp / f"d{nodes}", url, n, nodes, w, cb)
                rates[f"node{nodes}"].append(rate)
                doubles += double
            rate, double = drain(tmp / "d1b", url, n, 1, w, 1)
            rates["node1_cb1"].append(rate)
            doubles += double
            rates["ceil"].append(ceiling(url, n, w, cb))
            rates["ceil1"].append(ceiling(url, n, w, 1))
            latencies = pickup(tmp / "p", url, args.pickups)
            p50.append(1000 * statistics.median(latencies))
            p99.append(1000 * percentile(latencies, 99))
        print(f"  run {run + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items())
              + f", pickup p50 {p50[-1]:.2f} ms p99 {p99[-1]:.2f} ms, double claims so far {doubles}",
              file=sys.stderr, flush=True)
    m = {k: median(v) for k, v in rates.items()}
    b, r = "pg", {k: spread(v) for k, v in rates.items()}
    ratios = [100 * a / c for a, c in zip(rates["node1"], rates["ceil"], strict=True)]  # each run's own
    figures = [
        Figure(b, f"1 node drain, {w} workers, claim_batch {cb}", m["node1"], "tasks/s",
               f"{r['node1']}, N={n}; first claim .. last finish, every completion committed"),
        Figure(b, f"1 node drain, {w} workers, claim_batch 1", m["node1_cb1"], "tasks/s", r["node1_cb1"]),
        Figure(b, f"2 nodes drain, combined, claim_batch {cb}", m["node2"], "tasks/s", r["node2"]),
        Figure(b, f"3 nodes drain, combined, claim_batch {cb}", m["node3"], "tasks/s", r["node3"]),
        Figure(b, "double claims (attempts table), all runs", doubles, "tasks", "must be 0"),
        Figure(b, f"store ceiling, {w} loops, claim {cb}", m["ceil"], "tasks/s", f"{r['ceil']}; PostgresStore alone"),
        Figure(b, f"store ceiling, {w} loops, claim 1", m["ceil1"], "tasks/s", f"{r['ceil1']}; PostgresStore alone"),
        Figure(b, f"1 node / ceiling, claim_batch {cb}", median(ratios), "%", f"each run's own, {spread(ratios, 1)}"),
        Figure(b, "pickup across nodes p50", median(p50), "ms",
               f"{spread(p50, 2)}; {args.pickups} single submits on A, run on B"),
        Figure(b, "pickup across nodes p99", median(p99), "ms",
               f"{spread(p99, 2)}; submit on A -> NOTIFY -> B's attempt started"),
    ]
    notes = [f"durable figures: {fsync_note()}",
             "2 CPUs here run the nodes and PostgreSQL together: more nodes add contention, not cores"]
    report(f"PostgreSQL fleet: N={n} noop tasks, {w} workers per node", figures,
           reproduce("pg_throughput.py", args, DEFAULTS), args.summary, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
