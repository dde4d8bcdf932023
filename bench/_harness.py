"""What every benchmark shares: a real daemon subprocess in a temp dir, a tiny HTTP client, figures.

Benchmarks print figures and never pass or fail on time. Each one starts its own daemon(s) in a
temporary directory that is removed afterwards, with the configuration a user gets: every key at its
shipped default (log level info, claim_batch 32, the guards' floors...) except the node's id, its state
directory, store file and API port, and what the benchmark itself names (pool sizes, a task type).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def fsync_note(directory: Path | None = None, n: int = 200) -> str:
    """How fast this disk acknowledges fsync now: every durable figure moves with it (this VM's varied
    from ~0.1 to ~0.5 ms at the median between sessions), so each bench measures it in its own run."""
    with tempfile.NamedTemporaryFile(dir=directory) as f:
        took = []
        for _ in range(n):
            f.write(b"x" * 4096)
            f.flush()
            started = time.perf_counter()
            os.fsync(f.fileno())
            took.append(1000 * (time.perf_counter() - started))
    return (f"fsync of 4 KiB here now: p50 {percentile(took, 50):.2f} ms, p99 {percentile(took, 99):.2f} ms "
            "(real disks are often slower)")
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy for loopback


@dataclass(frozen=True)
class Figure:
    bench: str
    name: str
    value: float
    unit: str
    note: str = ""

    def line(self) -> str:
        if math.isnan(self.value):  # not measured: the note says why
            shown = "-"
        else:
            shown = f"{self.value:,.1f}" if abs(self.value) >= 100 else f"{self.value:,.3g}"
        return f"  {self.name:<44} {shown:>12} {self.unit:<8} {self.note}".rstrip()


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def spread(values: Sequence[float], digits: int = 0) -> str:
    """What a median stands on: "median of N, min A, max B", or "one run", which a figure of one run says."""
    kept = [v for v in values if not math.isnan(v)]
    if len(kept) <= 1:
        return "one run"
    return f"median of {len(kept)}, min {min(kept):,.{digits}f}, max {max(kept):,.{digits}f}"


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank percentile: the smallest value with at least p % of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered), math.ceil(p / 100 * len(ordered))) - 1)]


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) each thread of process `pid` has used so far, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread may end while we look
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            used[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return used


async def claim_finish_rate(store: Any, n: int, workers: int, claim_batch: int, lease_s: float) -> float:
    """Tasks/s of `workers` concurrent claim+finish loops on an open store holding `n` noop tasks: the
    store's own ceiling, with no pool, engine or leases around it. Raises unless all n were finished."""
    import anyio

    from tidepool.lifecycle import RetryPolicy
    from tidepool.model import AttemptStatus, ClaimFilter, Outcome, Worker, new_id

    instance, where, policy, success = new_id(), ClaimFilter(), RetryPolicy(), Outcome(AttemptStatus.SUCCEEDED)
    done = 0

    async def loop(k: int) -> None:
        nonlocal done
        me = Worker("ceiling", instance, f"ceiling/w{k}")
        while claimed := await store.claim(me, where, limit=claim_batch, now=time.time(), lease_s=lease_s):
            for c in claimed:
                await store.finish(c.lease, success, now=time.time(), policy=policy)
            done += len(claimed)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for k in range(workers):
            tg.start_soon(loop, k)
    elapsed = time.perf_counter() - started
    if done != n:
        raise RuntimeError(f"ceiling: {done} of {n} tasks finished")
    return n / elapsed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def toml(config: Mapping[str, Mapping[str, Any]]) -> str:
    """Enough TOML for flat sections of strings, numbers, booleans and lists of those."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(f"cannot write {v!r} as TOML")

    lines = []
    for section, keys in config.items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {value(v)}" for k, v in keys.items())
        lines.append("")
    return "\n".join(lines)


class HttpError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


class Daemon:
    """`tidepool run` as a subprocess on a free port, with its state in `state_dir`."""

    def __init__(self, state_dir: Path, *, overrides: Mapping[str, Mapping[str, Any]] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config: dict[str, dict[str, Any]] = {
            "node": {"id": "bench", "state_dir": str(state_dir)},
            "store": {"url": f"sqlite:///{state_dir / 'tidepool.db'}"},
            "api": {"listen": f"127.0.0.1:{self.port}"},
        }
        for section, keys in (overrides or {}).items():
            config.setdefault(section, {}).update(keys)
        state_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = state_dir / f"tidepool-{self.port}.toml"
        self.config_path.write_text(toml(config))
        self.db_path = state_dir / "tidepool.db"
        self._env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDEPOOL_", "NOTIFY_SOCKET"))}
        self._env.update(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = state_dir / f"daemon-{self.port}.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, *, timeout_s: float = 20.0) -> float:
        """Start and wait for /readyz 200; the monotonic time readiness was seen."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([PYTHON, "-m", "tidepool", "run", "--config", str(self.config_path)],
                                         cwd=self.state_dir, env=self._env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError, HttpError):
                self.get("/readyz", timeout_s=1.0)
                return time.monotonic()
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"daemon not ready within {timeout_s}s: {self.log_tail()}")

    def stop(self, *, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s; the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # HTTP

    def request(self, method: str, path: str, body: Any = None, *, timeout_s: float = 60.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with _OPENER.open(req, timeout=timeout_s) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            with exc:
                raise HttpError(exc.code, exc.read().decode(errors="replace")) from None

    def get(self, path: str, *, timeout_s: float = 60.0) -> Any:
        return self.request("GET", path, timeout_s=timeout_s)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def submit_batch(self, tasks: list[dict[str, Any]]) -> list[str]:
        ids: list[str] = self.post("/v1/tasks/batch", {"tasks": tasks})["ids"]
        return ids

    def pool(self) -> dict[str, Any]:
        pool: dict[str, Any] = self.get("/v1/pool")
        return pool

    def wait_drained(self, *, poll_s: float = 0.05, timeout_s: float = 120.0) -> float:
        """Poll /v1/pool until no task is queued, leased, running or cancelling; the monotonic time seen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not any(self.pool()["queue"].values()):
                return time.monotonic()
            time.sleep(poll_s)
        raise RuntimeError(f"queue not drained within {timeout_s}s: {self.pool()['queue']}")

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Read the daemon's SQLite file, read-only."""
        conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True)
        try:
            return conn.execute(sql, args).fetchall()
        finally:
            conn.close()


@contextlib.contextmanager
def running(state_dir: Path, **kwargs: Any) -> Iterator[Daemon]:
    daemon = Daemon(state_dir, **kwargs)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=f"tidepool-bench-{prefix}-") as d:
        yield Path(d)


def arguments(description: str, **defaults: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--summary", type=Path, help="append the figures as JSON lines to this file")
    return parser


def reproduce(script: str, args: argparse.Namespace, defaults: Mapping[str, Any]) -> str:
    extra = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in defaults if getattr(args, k) != defaults[k]]
    return shlex.join([".venv/bin/python", f"bench/{script}", *extra])


def report(title: str, figures: list[Figure], command: str, summary: Path | None,
           notes: Sequence[str] = ()) -> None:
    print(f"\n== {title}")
    for figure in figures:
        print(figure.line())
    for note in notes:
        print(f"  note: {note}")
    print(f"  reproduce: {command}   (from {REPO})")
    sys.stdout.flush()
    if summary is not None:
        with open(summary, "a") as f:
            for figure in figures:  # with its command, so that run_all.py can print each row beside it
                f.write(json.dumps({**asdict(figure), "command": command}) + "\n")
