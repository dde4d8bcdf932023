"""Throughput: enqueue rate through POST /v1/tasks/batch, drain rate of one daemon, and the store's ceiling.

Per run (median of --runs):
  enqueue  a daemon that accepts no task type (TIDEPOOL_POOL__TASK_TYPES='["nothing"]') takes N noop
           tasks in batches of --batch; rate = N / (first POST .. last 201).
  drain    that daemon is stopped; a fresh one with pool.min_workers = max_workers = --workers starts on
           the same state dir with all N already queued; rate = N / (first claim .. last finish), both
           times as the daemon recorded them in its SQLite file (read read-only afterwards). The same
           queue, copied before draining, is drained again with pool.claim_batch = --claim-batch (1: each
           worker claims for itself, as before a claim filled every idle worker).
  ceiling  no daemon: tidepool.store.sqlite.SqliteStore driven by --workers concurrent claim+finish
           loops on the same N tasks; daemon / ceiling shows what the pool, engine and leases cost.
  bare     no tidepool at all: sqlite3 claiming and completing N tasks 64 per transaction (see
           sqlite_reference), this machine's speed in this run; it has varied ~3x between sessions.
  peers    the same N no-op tasks queued first, then drained by pgqueuer (PostgreSQL) and by dramatiq
           (Redis, --workers threads), each at its own defaults (see peers.py); --peers= leaves them out.
The daemons run at the shipped defaults (log level info, claim_batch 32): only the pool's size, and
for the second drain claim_batch, are set. The ratio rows compare the figures of this one run.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import peers
from _harness import (
    Daemon,
    Figure,
    arguments,
    claim_finish_rate,
    fsync_note,
    median,
    report,
    reproduce,
    spread,
    temp_dir,
    thread_cpu_s,
)

SHIPPED_CLAIM_BATCH = 32  # pool.claim_batch's default: the most one claim leases
DEFAULTS: dict[str, Any] = {"n": 20_000, "batch": 1000, "workers": 32, "claim_batch": 1, "runs": 3,
                            "peers": ",".join(peers.PEERS)}


def enqueue(state_dir: Path, n: int, batch: int) -> float:
    """Tasks/s accepted by a daemon that runs none of them."""
    daemon = Daemon(state_dir, env={"TIDEPOOL_POOL__TASK_TYPES": '["nothing"]'})
    daemon.start()
    try:
        bodies = [[{"type": "noop"}] * min(batch, n - i) for i in range(0, n, batch)]
        started = time.perf_counter()
        for body in bodies:
            daemon.submit_batch(body)
        elapsed = time.perf_counter() - started
    finally:
        code = daemon.stop()
    if code != 0:
        raise RuntimeError(f"enqueue daemon exited {code}: {daemon.log_tail()}")
    return n / elapsed


def copy_store(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for name in ("tidepool.db", "tidepool.db-wal"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def drain(state_dir: Path, n: int, workers: int, claim_batch: int | None = None) -> tuple[float, float, float, float]:
    """(tasks/s between first claim and last finish as stored, seconds from /readyz 200 to all completed seen,
    CPU µs per task of the event loop's thread, of all other threads: the SQLite writer and readers).

    The pool starts claiming a moment before the API answers, so the stored span is the fair one.
    """
    pool: dict[str, Any] = {"min_workers": workers, "max_workers": workers}
    if claim_batch is not None:  # else the shipped default
        pool["claim_batch"] = claim_batch
    daemon = Daemon(state_dir, overrides={"pool": pool})
    ready = daemon.start(timeout_s=60)
    pid = daemon.pid
    try:
        before = thread_cpu_s(pid)
        seen = daemon.wait_drained(poll_s=0.25)  # each poll counts the queue: keep it off the measured CPU
        used = {tid: s - before.get(tid, 0.0) for tid, s in thread_cpu_s(pid).items()}
    finally:
        daemon.stop()
    (completed,), = daemon.query("SELECT count(*) FROM tasks WHERE state = 'completed'")
    (first, last), = daemon.query("SELECT (SELECT min(started_at) FROM attempts), max(finished_at) FROM tasks")
    if completed != n:
        raise RuntimeError(f"drain: {completed} of {n} tasks completed: {daemon.log_tail()}")
    loop_us = 1e6 * used.pop(pid, 0.0) / n  # the main thread runs the event loop
    return n / (last - first), seen - ready, loop_us, 1e6 * sum(used.values()) / n


def store_ceiling(state_dir: Path, n: int, workers: int, claim_batch: int) -> float:
    """Tasks/s of `workers` concurrent claim+finish loops on SqliteStore itself (uvloop, like the daemon)."""
    import anyio

    from tidepool.model import NewTask
    from tidepool.store.sqlite import SqliteStore

    async def main() -> float:
        store = SqliteStore(state_dir / "ceiling.db")
        await store.open()
        try:
            for i in range(0, n, 1000):
                await store.add_many([NewTask("noop")] * min(1000, n - i), now=time.time())
            return await claim_finish_rate(store, n, workers, claim_batch, lease_s=30.0)
        finally:
            await store.close()

    rate: float = anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    return rate


def sqlite_reference(path: Path, n: int, group: int = 64) -> float:
    """Claim+complete/s of bare sqlite3 (WAL, synchronous=FULL), `group` tasks per transaction: each
    claim leases a task and inserts its attempt, each completion ends both. What any durable queue on
    SQLite must write, with no pool, engine or events: a ceiling for this machine in this run."""
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.executescript("""
        CREATE TABLE tasks (id INTEGER PRIMARY KEY, state TEXT NOT NULL, priority INTEGER NOT NULL,
                            created_at REAL NOT NULL, attempt INTEGER NOT NULL DEFAULT 0, finished_at REAL);
        CREATE INDEX claimable ON tasks (state, priority DESC, created_at);
        CREATE TABLE attempts (id INTEGER PRIMARY KEY, task_id INTEGER NOT NULL, token TEXT NOT NULL,
                               started_at REAL NOT NULL, finished_at REAL, status TEXT NOT NULL);
        CREATE INDEX attempts_task ON attempts (task_id);
    """)
    now = time.time()
    conn.executemany("INSERT INTO tasks (state, priority, created_at) VALUES ('pending', 0, ?)",
                     [(now + i,) for i in range(n)])
    started, done = time.perf_counter(), 0
    while True:
        conn.execute("BEGIN IMMEDIATE")
        ids = conn.execute("UPDATE tasks SET state = 'leased', attempt = attempt + 1 WHERE id IN (SELECT id FROM "
                           "tasks WHERE state = 'pending' ORDER BY priority DESC, created_at LIMIT ?) RETURNING id",
                           (group,)).fetchall()
        now = time.time()
        conn.executemany("INSERT INTO attempts (task_id, token, started_at, status) VALUES (?, ?, ?, 'running')",
                         [(i, os.urandom(8).hex(), now) for (i,) in ids])
        ended = [(now, i) for (i,) in ids]
        conn.executemany("UPDATE attempts SET status = 'succeeded', finished_at = ? WHERE task_id = ?", ended)
        conn.executemany("UPDATE tasks SET state = 'completed', finished_at = ? WHERE id = ?", ended)
        conn.execute("COMMIT")
        done += len(ids)
        if not ids:
            break
    elapsed = time.perf_counter() - started
    conn.close()
    if done != n:
        raise RuntimeError(f"reference: {done} of {n} tasks completed")
    return n / elapsed


def one_run(tmp: Path, args: Any, skipped: dict[str, str]) -> dict[str, float]:
    """Every figure of one run, on fresh state in `tmp`; a peer that could not run is NaN, its reason
    kept in `skipped`."""
    n, workers = args.n, args.workers
    got = {"enqueue": enqueue(tmp / "a", n, args.batch)}
    copy_store(tmp / "a", tmp / "b")
    got["drain1"], got["wall1"], got["loop_us"], got["others_us"] = drain(tmp / "a", n, workers)
    got["drainN"] = drain(tmp / "b", n, workers, args.claim_batch)[0]
    for peer in filter(None, args.peers.split(",")):
        rate = peers.drain(peer, n, workers)
        if isinstance(rate, peers.Skipped):
            skipped[peer], rate = rate.reason, math.nan
        got[peer] = rate
    got["ceil1"] = store_ceiling(tmp / "c1", n, workers, 1)
    got["ceilN"] = store_ceiling(tmp / "c2", n, workers, SHIPPED_CLAIM_BATCH)
    got["bare"] = sqlite_reference(tmp / "bare.db", n)
    got["vs_bare"] = 100 * got["drain1"] / got["bare"]  # against the reference of this same run
    got["vs_ceil1"] = 100 * got["drain1"] / got["ceil1"]
    for peer in filter(None, args.peers.split(",")):
        got[f"vs_{peer}"] = got["drain1"] / got[peer]
    return got


def peer_figures(m: dict[str, float], rates: dict[str, list[float]], args: Any,
                 skipped: dict[str, str]) -> list[Figure]:
    """Each peer's drain, and tidepool's at the shipped defaults over it in the same run (the goal: at least 3 x)."""
    b, figures = "throughput", []
    for peer in filter(None, args.peers.split(",")):
        how = {"pgqueuer": "PostgreSQL, its defaults", "dramatiq": f"Redis, {args.workers} threads, prefetches"}
        note = skipped.get(peer, f"{how.get(peer, '')}; {spread(rates[peer])}; first start .. last finish")
        figures.append(Figure(b, f"{peer} {peers.version(peer)}, drain", m[peer], "tasks/s", note))
    for peer in filter(None, args.peers.split(",")):
        figures.append(Figure(b, f"tidepool / {peer}, drain at the defaults", m[f"vs_{peer}"], "x", skipped.get(
            peer, f"each run's own ratio, {spread(rates[f'vs_{peer}'], 2)}; the goal: at least 3")))
    return figures


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    n, workers, cb, scb = args.n, args.workers, args.claim_batch, SHIPPED_CLAIM_BATCH
    rates: dict[str, list[float]] = {}
    skipped: dict[str, str] = {}
    for run in range(args.runs):
        with temp_dir("throughput") as tmp:
            for key, value in one_run(tmp, args, skipped).items():
                rates.setdefault(key, []).append(value)
        print(f"  run {run + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()),
              file=sys.stderr, flush=True)
    m = {k: median([x for x in v if not math.isnan(x)] or [math.nan]) for k, v in rates.items()}
    b, r = "throughput", {k: spread(v) for k, v in rates.items()}
    figures = [
        Figure(b, f"enqueue, batches of {args.batch}", m["enqueue"], "tasks/s", f"{r['enqueue']}, N={n}"),
        Figure(b, f"drain, {workers} workers, shipped defaults", m["drain1"], "tasks/s",
               f"{r['drain1']}; claim_batch {scb}, log level info; first claim .. last finish"),
        Figure(b, f"drain, {workers} workers, claim_batch {cb}", m["drainN"], "tasks/s", r["drainN"]),
        *peer_figures(m, rates, args, skipped),
        Figure(b, f"store ceiling, {workers} loops, claim 1", m["ceil1"], "tasks/s",
               f"{r['ceil1']}; SqliteStore alone"),
        Figure(b, f"store ceiling, {workers} loops, claim {scb}", m["ceilN"], "tasks/s",
               f"{r['ceilN']}; SqliteStore alone, each loop runs its {scb} in turn"),
        Figure(b, "bare sqlite3, claim+complete 64 a transaction", m["bare"], "tasks/s",
               f"{r['bare']}; this machine now"),
        Figure(b, "daemon at the defaults / ceiling, claim 1", m["vs_ceil1"], "%",
               f"each run's own ratio, {spread(rates['vs_ceil1'], 1)}"),
        Figure(b, "daemon at the defaults / bare sqlite3", m["vs_bare"], "%",
               f"each run's own ratio, {spread(rates['vs_bare'], 1)}; the goal: at least 30 %"),
        Figure(b, "drain wall, /readyz .. all completed seen", m["wall1"], "s",
               f"{spread(rates['wall1'], 2)}; shipped defaults; claiming starts just before /readyz"),
        Figure(b, "drain CPU per task, event loop thread", m["loop_us"], "µs",
               f"{r['loop_us']}; shipped defaults; from /proc"),
        Figure(b, "drain CPU per task, other threads", m["others_us"], "µs",
               f"{r['others_us']}; the SQLite writer (and readers), sharing the GIL with the loop"),
    ]
    report(f"throughput: N={n} noop tasks, SQLite store, shipped defaults", figures,
           reproduce("throughput.py", args, DEFAULTS), args.summary, [f"durable figures: {fsync_note()}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
