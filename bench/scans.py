"""Scans: what running a profile step by step costs over independent tasks, and a step's hand-off latency.

Per run (median of --runs):
  chain    --scans scans of a profile of --steps no-op steps are submitted one by one (POST /v1/scans) to a
           daemon that claims nothing (TIDEPOOL_POOL__TASK_TYPES='["nothing"]'), so each waits with its first
           step's task queued; a fresh daemon with pool.min_workers = max_workers = --workers then drains them
           on the same SQLite file. Time per step = (first claim .. last finish, as the daemon stored them) /
           (scans * steps): each step after the first is created in the transaction that ends the one before.
  tasks    the same number of independent no-op tasks (POST /v1/tasks/batch, batches of 1000), drained the
           same way in the same run: time per task. The ratio compares the two from this one run.
  store    no daemon: the store (SqliteStore, or PostgresStore) driven by --workers concurrent claim+finish loops,
           on the same scans and on the same number of independent tasks: what the store's step transaction
           costs on its own (the daemon's ratio above is mostly this one).
  handoff  an idle daemon (the shipped pool) runs --handoff scans one at a time, each waited for: for every
           step after the first, its task's start - the previous step's end (both daemon stamps: the end's
           transaction creates the next task, a worker is woken, claims and starts it).
--store sqlite (a file in each part's state dir) or postgres (each part on a fresh schema of the server at --url,
dropped after it): the same rows on either.
"""

from __future__ import annotations

import contextlib
import itertools
import sqlite3
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from _harness import (
    Daemon,
    Figure,
    arguments,
    fsync_note,
    median,
    percentile,
    report,
    reproduce,
    running,
    spread,
    temp_dir,
)
from pg_throughput import fetch, schema

DEFAULTS: dict[str, Any] = {"scans": 2000, "steps": 3, "workers": 16, "handoff": 100, "runs": 3, "store": "sqlite",
                            "url": "postgresql://postgres@127.0.0.1:5432/test"}
CLAIMS_NOTHING = {"TIDEPOOL_POOL__TASK_TYPES": '["nothing"]'}
Reader = Callable[[str], list[Any]]  # a query's rows, read from a part's store


@contextlib.contextmanager
def store_of(state_dir: Path, store: str, url: str) -> Iterator[tuple[dict[str, dict[str, Any]], Reader]]:
    """A part's store: (the daemons' config for it, a reader of its rows)."""
    if store == "sqlite":
        path = state_dir / "tidepool.db"

        def read(sql: str) -> list[Any]:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            try:
                return conn.execute(sql).fetchall()
            finally:
                conn.close()

        yield {}, read
        return
    with schema(url) as name:
        yield {"store": {"url": f"{url}?schema={name}"}}, lambda sql: fetch(url, name, sql)


def ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def profile(steps: int) -> dict[str, dict[str, Any]]:
    return {"profiles.chain": {"steps": ["noop"] * steps}}


def queue_scans(state_dir: Path, scans: int, steps: int, store: dict[str, dict[str, Any]]) -> None:
    daemon = Daemon(state_dir, overrides={**profile(steps), **store}, env=CLAIMS_NOTHING)
    daemon.start()
    try:
        for _ in range(scans):
            daemon.post("/v1/scans", {"profile": "chain"})
    finally:
        daemon.stop()


def queue_tasks(state_dir: Path, n: int, store: dict[str, dict[str, Any]]) -> None:
    daemon = Daemon(state_dir, overrides=store, env=CLAIMS_NOTHING)
    daemon.start()
    try:
        for i in range(0, n, 1000):
            daemon.submit_batch([{"type": "noop"}] * min(1000, n - i))
    finally:
        daemon.stop()


def drain_s(state_dir: Path, n: int, workers: int, steps: int, store: dict[str, dict[str, Any]],
            read: Reader) -> float:
    """Seconds from the first claim to the last finish of all n tasks, as the daemon stored them."""
    daemon = Daemon(state_dir, overrides={**profile(steps), **store,
                                          "pool": {"min_workers": workers, "max_workers": workers}})
    daemon.start(timeout_s=60)
    try:
        deadline = time.monotonic() + 300
        while read("SELECT count(*) FROM tasks WHERE state = 'completed'")[0][0] < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not drained within 300 s: {daemon.log_tail()}")
            time.sleep(0.05)
        (first, last), = read("SELECT min(started_at), max(finished_at) FROM attempts")
    finally:
        daemon.stop()
    return float(last - first)


def chain_and_tasks(tmp: Path, k: int, scans: int, steps: int, workers: int, store: str,
                    url: str) -> tuple[float, float]:
    """(seconds per scan step, seconds per independent task) of one run."""
    n = scans * steps
    with store_of(tmp / f"chain-{k}", store, url) as (config, read):
        queue_scans(tmp / f"chain-{k}", scans, steps, config)
        per_step = drain_s(tmp / f"chain-{k}", n, workers, steps, config, read) / n
    with store_of(tmp / f"tasks-{k}", store, url) as (config, read):
        queue_tasks(tmp / f"tasks-{k}", n, config)
        per_task = drain_s(tmp / f"tasks-{k}", n, workers, steps, config, read) / n
    return per_step, per_task


def store_rates(tmp: Path, k: int, scans: int, steps: int, workers: int, store: str,
                url: str) -> tuple[float, float]:
    """(steps/s, tasks/s) of --workers claim+finish loops on the bare store, no daemon around it."""
    import anyio

    from tidepool.model import NewTask
    from tidepool.scans import NewScan, StepSpec

    @contextlib.asynccontextmanager
    async def sqlite(part: str) -> AsyncIterator[Any]:
        from tidepool.store.sqlite import SqliteStore

        opened = SqliteStore(str(tmp / f"store-{part}-{k}.db"))
        await opened.open()
        try:
            yield opened
        finally:
            await opened.close()

    @contextlib.asynccontextmanager
    async def postgres(part: str) -> AsyncIterator[Any]:
        import asyncpg

        from tidepool.store.postgres import PostgresStore

        name = f"bench_{part}_{uuid.uuid4().hex[:12]}"
        opened = PostgresStore(url, schema=name)
        try:
            await opened.open()
            yield opened
        finally:
            await opened.close()
            admin = await asyncpg.connect(url)
            try:
                await admin.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
            finally:
                await admin.close()

    async def measure() -> tuple[float, float]:
        opened = sqlite if store == "sqlite" else postgres
        async with opened("chain") as chained:
            for _ in range(scans):
                await chained.add_scan(NewScan("chain", (StepSpec("noop"),) * steps), now=time.time())
            step_rate = await claim_finish_loops(chained, scans * steps, workers)
        async with opened("tasks") as plain:
            await plain.add_many([NewTask("noop", {}, 0, 3, None, (), None, None)] * (scans * steps),
                                 now=time.time())
            task_rate = await claim_finish_loops(plain, scans * steps, workers)
        return step_rate, task_rate

    return anyio.run(measure)


async def claim_finish_loops(store: Any, n: int, workers: int) -> float:
    """Items/s of `workers` claim+finish loops until n tasks have finished: a step's next task appears only
    when the step before it finishes, so a loop that finds none waits a moment while others are at work."""
    import anyio

    from tidepool.lifecycle import RetryPolicy
    from tidepool.model import AttemptStatus, ClaimFilter, Outcome, Worker, new_id

    instance, where, policy, success = new_id(), ClaimFilter(), RetryPolicy(), Outcome(AttemptStatus.SUCCEEDED)
    done = 0

    async def loop(i: int) -> None:
        nonlocal done
        me = Worker("bench", instance, f"bench/w{i}")
        while done < n:
            claimed = await store.claim(me, where, limit=1, now=time.time(), lease_s=30.0)
            if not claimed:
                await anyio.sleep(0.0005)
            for c in claimed:
                await store.finish(c.lease, success, now=time.time(), policy=policy)
                done += 1

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(workers):
            tg.start_soon(loop, i)
    return n / (time.perf_counter() - started)


def handoffs(tmp: Path, k: int, scans: int, steps: int, store: str, url: str) -> list[float]:
    """Seconds from each step's end to its next step's start, scans run one at a time on an idle daemon."""
    gaps = []
    with (store_of(tmp / f"handoff-{k}", store, url) as (config, _),
          running(tmp / f"handoff-{k}", overrides={**profile(steps), **config}) as daemon):
        time.sleep(0.5)  # the start-up claims settle: the daemon is idle
        for _ in range(scans):
            scan = daemon.post("/v1/scans", {"profile": "chain"})
            while scan["state"] not in ("succeeded", "failed", "cancelled"):
                time.sleep(0.002)
                scan = daemon.get(f"/v1/scans/{scan['id']}")
            attempts = [daemon.get(f"/v1/tasks/{job['task_id']}")["attempts"][0] for job in scan["jobs"]]
            gaps += [ts(after["started_at"]) - ts(before["finished_at"])
                     for before, after in itertools.pairwise(attempts)]
    return gaps


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    per_step, per_task, p50, p99, store_steps, store_tasks = [], [], [], [], [], []
    with temp_dir("scans") as tmp:
        for k in range(args.runs):
            step_s, task_s = chain_and_tasks(tmp, k, args.scans, args.steps, args.workers, args.store, args.url)
            per_step.append(step_s)
            per_task.append(task_s)
            step_rate, task_rate = store_rates(tmp, k, args.scans, args.steps, args.workers, args.store,
                                               args.url)
            store_steps.append(step_rate)
            store_tasks.append(task_rate)
            gaps = handoffs(tmp, k, args.handoff, args.steps, args.store, args.url)
            p50.append(percentile(gaps, 50))
            p99.append(percentile(gaps, 99))
            print(f"  run {k + 1}: {1e6 * step_s:.0f} µs per step, {1e6 * task_s:.0f} µs per task; store alone "
                  f"{step_rate:.0f} steps/s, {task_rate:.0f} tasks/s; "
                  f"hand-off p50 {1000 * p50[-1]:.2f} ms p99 {1000 * p99[-1]:.2f} ms", flush=True)
    b = "scans" if args.store == "sqlite" else f"scans on {args.store}"
    ratios = [s / t for s, t in zip(per_step, per_task, strict=True)]
    store_ratios = [t / s for s, t in zip(store_steps, store_tasks, strict=True)]
    n = args.scans * args.steps
    figures = [
        Figure(b, f"time per scan step ({args.scans} x {args.steps} no-op)", 1e6 * median(per_step), "µs",
               spread([1e6 * x for x in per_step])),
        Figure(b, f"time per independent no-op task ({n})", 1e6 * median(per_task), "µs",
               spread([1e6 * x for x in per_task])),
        Figure(b, "step / task, same run", median(ratios), "x", f"each run's own, {spread(ratios, 2)}"),
        Figure(b, "store alone: steps claimed and finished", median(store_steps), "/s", spread(store_steps)),
        Figure(b, "store alone: independent tasks claimed and finished", median(store_tasks), "/s",
               spread(store_tasks)),
        Figure(b, "store alone: tasks / steps, same run", median(store_ratios), "x",
               f"each run's own, {spread(store_ratios, 2)}"),
        Figure(b, "hand-off p50 (step end .. next step start)", 1000 * median(p50), "ms",
               spread([1000 * x for x in p50], 2)),
        Figure(b, "hand-off p99", 1000 * median(p99), "ms",
               f"{spread([1000 * x for x in p99], 2)}; {args.handoff * (args.steps - 1)} each"),
    ]
    shown = {"sqlite": "SQLite", "postgres": "PostgreSQL"}[args.store]
    report(f"scans: {args.scans} scans of {args.steps} no-op steps vs {n} tasks, {args.workers} workers, {shown}",
           figures, reproduce("scans.py", args, DEFAULTS), args.summary, [f"durable figures: {fsync_note()}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
