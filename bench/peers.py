"""The same two workloads on pgqueuer (PostgreSQL) and dramatiq (Redis), each at its own defaults.

  drain  N no-op tasks are queued first, then one worker process starts; rate = N / (the first task
         function's start .. the last one's return), as that process timed them. pgqueuer then commits
         each outcome within its log buffer's 0.1 s; dramatiq acks it in Redis (not durable).
  w2     one worker process at concurrency --workers is started and idle; then the tasks (sleeps) are
         queued and wall = first enqueue .. the queue seen empty of them (polled every 10 ms, as the
         daemon's benchmark polls its API).

pgqueuer runs `QueueManager.run()` with its defaults (batch_size 10; the drain with no concurrency
limit, W2 with max_concurrent_tasks = --workers) in a schema of its own on the PostgreSQL at
--pg-url, dropped afterwards. dramatiq runs one `Worker` with --workers threads and its default
middleware and prefetch (twice the threads) on the Redis at --redis-url, under a namespace of its
own whose keys are deleted afterwards. A peer that is not installed or cannot be reached gives a
`Skipped` with the reason, never an exception.

The worker side runs in a process of its own (`peers.py worker ...`, started by `run_peer`), as the
daemon does, so the process that queues and polls never shares a GIL with the one measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"
PEERS = ("pgqueuer", "dramatiq")
HERE = Path(__file__).resolve()


@dataclass(frozen=True)
class Skipped:
    reason: str


def version(peer: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(peer)
    except PackageNotFoundError:
        return "not installed"


def drain(peer: str, n: int, workers: int, *, pg_url: str = PG_URL, redis_url: str = REDIS_URL) -> float | Skipped:
    """Tasks/s of the peer's worker on a queue already holding n no-op tasks (dramatiq with `workers`
    threads; pgqueuer without a concurrency limit, its default)."""
    return _guarded(peer, "drain", n, 0 if peer == "pgqueuer" else workers, 0.0, pg_url, redis_url)


def w2(peer: str, tasks: int, seconds: float, workers: int, *, pg_url: str = PG_URL,
       redis_url: str = REDIS_URL) -> float | Skipped:
    """Wall seconds for `tasks` sleeps of `seconds` submitted to an idle worker at concurrency `workers`."""
    return _guarded(peer, "w2", tasks, workers, seconds, pg_url, redis_url)


def _guarded(peer: str, mode: str, n: int, workers: int, seconds: float, pg_url: str,
             redis_url: str) -> float | Skipped:
    if version(peer) == "not installed":
        return Skipped(f"{peer} is not installed (pip install -e '.[bench]')")
    try:
        if peer == "pgqueuer":
            return _pgqueuer(mode, n, workers, seconds, pg_url)
        return _dramatiq(mode, n, workers, seconds, redis_url)
    except Exception as exc:  # a peer that fails is a row saying why, never the end of the benchmark
        return Skipped(f"{peer} {mode} failed: {type(exc).__name__}: {str(exc)[:200]}")


# The side that queues, polls and cleans up (this process)


def _pgqueuer(mode: str, n: int, workers: int, seconds: float, pg_url: str) -> float:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries
    from pgqueuer.adapters.persistence.qb import QueryBuilderEnvironment, QueryQueueBuilder, QuerySchedulerBuilder
    from pgqueuer.domain.settings import DBSettings

    schema, prefix = "bench_pgq_" + uuid.uuid4().hex[:10], f"b{uuid.uuid4().hex[:8]}_"
    settings = DBSettings(prefix=prefix, db_schema=schema)
    env = {"PGQUEUER_SCHEMA": schema, "PGQUEUER_PREFIX": prefix}
    payload = None if mode == "drain" else json.dumps({"seconds": seconds}).encode()
    entrypoint = "noop" if mode == "drain" else "sleep"

    async def connect() -> tuple[Any, Any]:
        conn = await asyncpg.connect(pg_url)
        return conn, Queries(AsyncpgDriver(conn), qbe=QueryBuilderEnvironment(settings),
                             qbq=QueryQueueBuilder(settings), qbs=QuerySchedulerBuilder(settings))

    async def enqueue() -> None:
        conn, queries = await connect()
        try:
            await queries.enqueue([entrypoint] * n, [payload] * n, [0] * n)
        finally:
            await conn.close()

    async def install() -> None:
        conn, queries = await connect()
        try:
            await queries.install()
        finally:
            await conn.close()

    async def wait_empty(started: float) -> float:
        conn = await asyncpg.connect(pg_url)
        try:
            while await conn.fetchval(f'SELECT count(*) FROM "{schema}"."{settings.queue_table}"'):
                await asyncio.sleep(0.01)
            return time.monotonic() - started
        finally:
            await conn.close()

    async def drop() -> None:
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()

    try:
        asyncio.run(install())
        if mode == "drain":
            asyncio.run(enqueue())
            return n / _worker_span("pgqueuer", mode, n, workers, pg_url, env)
        with _ready_worker("pgqueuer", mode, n, workers, pg_url, env):
            started = time.monotonic()
            asyncio.run(enqueue())
            return asyncio.run(wait_empty(started))
    finally:
        asyncio.run(drop())


def _dramatiq(mode: str, n: int, workers: int, seconds: float, redis_url: str) -> float:
    import redis

    namespace = "tidepool-bench-" + uuid.uuid4().hex[:10]
    env = {"BENCH_DRAMATIQ_NAMESPACE": namespace}
    broker, actor = _dramatiq_actor(namespace, redis_url, mode)
    client = redis.Redis.from_url(redis_url)
    args = () if mode == "drain" else (seconds,)
    try:
        if mode == "drain":
            for _ in range(n):
                actor.send(*args)
            return n / _worker_span("dramatiq", mode, n, workers, redis_url, env)
        with _ready_worker("dramatiq", mode, n, workers, redis_url, env):
            started = time.monotonic()
            for _ in range(n):
                actor.send(*args)
            while client.hlen(f"{namespace}:default.msgs"):  # a message leaves this hash when acked
                time.sleep(0.01)
            return time.monotonic() - started
    finally:
        broker.close()
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def _dramatiq_actor(namespace: str, redis_url: str, mode: str) -> tuple[Any, Any]:
    """A broker on `namespace` and the benchmark's actor on it: the no-op for a drain, a sleep for W2."""
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=redis_url, namespace=namespace)
    dramatiq.set_broker(broker)
    if mode == "drain":
        return broker, dramatiq.actor(_dramatiq_noop, actor_name="noop", broker=broker)
    return broker, dramatiq.actor(_dramatiq_sleep, actor_name="sleep", broker=broker)


def _dramatiq_noop() -> None:
    _Timing.mark_start()
    _Timing.mark_end()


def _dramatiq_sleep(seconds: float) -> None:
    _Timing.mark_start()
    time.sleep(seconds)
    _Timing.mark_end()


def _worker_command(peer: str, mode: str, n: int, workers: int, url: str) -> list[str]:
    return [sys.executable, str(HERE), "worker", peer, mode, f"--n={n}", f"--workers={workers}", f"--url={url}"]


def _worker_span(peer: str, mode: str, n: int, workers: int, url: str, env: dict[str, str]) -> float:
    """Start the worker process on a full queue; the seconds from its first task's start to its last's end."""
    out = subprocess.run(_worker_command(peer, mode, n, workers, url), env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker exited {out.returncode}: {out.stderr.strip()[-300:]}")
    span: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return span["last"] - span["first"]


@contextlib.contextmanager
def _ready_worker(peer: str, mode: str, n: int, workers: int, url: str, env: dict[str, str]) -> Iterator[None]:
    """A worker process that has started and is waiting for work; stopped (and checked) on exit."""
    proc = subprocess.Popen(_worker_command(peer, mode, n, workers, url), env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"worker did not start: {proc.communicate(timeout=10)[1].strip()[-300:]}")
        time.sleep(0.5)  # its listener (pgqueuer's LISTEN, dramatiq's consumer) is up after the first poll
        yield
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"worker exited {proc.returncode}: {err.strip()[-300:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# The worker side (a process of its own)


class _Timing:
    """When the worker's first task started and its last ended (wall clock), and how many ended."""

    first = last = 0.0
    done = 0
    expected = 0
    lock = threading.Lock()
    all_done = threading.Event()
    on_all_done: Callable[[], None] = all_done.set

    @classmethod
    def mark_start(cls) -> None:
        if not cls.first:
            cls.first = time.time()

    @classmethod
    def mark_end(cls) -> None:
        with cls.lock:
            cls.last = time.time()
            cls.done += 1
            if cls.done == cls.expected:
                cls.on_all_done()

    @classmethod
    def emit(cls) -> None:
        print(json.dumps({"first": cls.first, "last": cls.last}), flush=True)


def _pgqueuer_worker(workers: int, url: str) -> None:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.models import Job

    async def main() -> None:
        conn = await asyncpg.connect(url)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))

        @qm.entrypoint("noop")
        async def noop(job: Job) -> None:
            _Timing.mark_start()
            _Timing.mark_end()

        @qm.entrypoint("sleep")
        async def sleep(job: Job) -> None:
            _Timing.mark_start()
            await asyncio.sleep(json.loads(job.payload or b"{}")["seconds"])
            _Timing.mark_end()

        _Timing.on_all_done = qm.shutdown.set  # its tasks run on this loop: no thread to wake
        print("ready", flush=True)
        try:
            await qm.run(max_concurrent_tasks=workers or None)
        finally:
            await conn.close()

    asyncio.run(main())


def _dramatiq_worker(mode: str, workers: int, url: str) -> None:
    from dramatiq import Worker

    broker, _ = _dramatiq_actor(os.environ["BENCH_DRAMATIQ_NAMESPACE"], url, mode)
    worker = Worker(broker, worker_threads=workers)
    worker.start()
    print("ready", flush=True)
    _Timing.all_done.wait()
    worker.stop()
    broker.close()


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="one peer's worker process (started by peers.run_peer)")
    parser.add_argument("peer", choices=PEERS)
    parser.add_argument("mode", choices=("drain", "w2"))
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--url", required=True)
    args = parser.parse_args(argv)
    _Timing.expected = args.n
    if args.peer == "pgqueuer":
        _pgqueuer_worker(args.workers, args.url)
    else:
        _dramatiq_worker(args.mode, args.workers, args.url)
    _Timing.emit()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"]:
        sys.exit("usage: peers.py worker PEER MODE --n N [--workers W] --url URL (throughput.py and w2.py use it)")
    sys.exit(_worker_main(sys.argv[2:]))
