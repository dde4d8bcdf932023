"""Gateway: remote workers' drain against a local one, their pickup, the gateway at scale, and a revoke's reach.

Every daemon is `tidepool run` as a subprocess with its certificates made by `tidepool.pki.make_lab`.
The gateway is the shipped configuration but for its listener and files, `enroll = "auto"` (no operator
enables the bench's workers) and a pool that takes no type (every task goes to the remote workers); the
remote workers are the shipped configuration but for their store (the gateway, with their certificate)
and, where said, their pool's size. Rows (--rows picks some):

  drain    N noop tasks queued first (by a daemon that runs none), the queue copied; one copy drained by
           two remote workers of --workers each through a gateway on it, the other by one local node of
           2 x --workers on the same machine, both pools at the same pool.claim_batch (--claim-batch, the
           shipped 32 unless set; a remote acquire asks for at most 256); rate = N / (first attempt's
           start .. last finish) as the SQLite file recorded them; median of --runs; the ratio of the two
           medians, and of each run's pair.
  pickup   one idle remote worker (the default pool); --pickups noop tasks submitted one at a time to the
           gateway; pickup = the worker's own `plugin.started` stamp (read from its event stream) minus
           when the submit's answer came back; beside it, the gateway's stamps (created .. leased).
  scale    a load client in this process (gateway_load.py) holds --parked acquires from --identities
           identities against an idle gateway; its CPU (all threads, % of one core) over --windows windows
           of --window-s, its RSS, then --submits tasks submitted one at a time: submit sent .. lease
           received by the load client.
  revoke   a remote worker runs a command (a shell and two sleeps); the operator revokes the worker; time
           until every process of that tree is gone and until the task reads `cancelled`; --revokes times,
           a fresh worker identity each (a revoke is final).
Figures only: nothing here passes or fails on time.
"""

from __future__ import annotations

import asyncio
import json
import resource
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from _harness import (
    Daemon,
    Figure,
    arguments,
    free_port,
    fsync_note,
    median,
    percentile,
    report,
    reproduce,
    spread,
    temp_dir,
    thread_cpu_s,
)
from gateway_load import LoadClient, cpu_percent
from latency import ts
from throughput import copy_store, drain, enqueue
from tidepool.gateway import pki

DEFAULTS: dict[str, Any] = {"rows": "drain,pickup,scale,revoke", "n": 20_000, "batch": 1000, "workers": 16,
                            "claim_batch": 32, "runs": 3, "pickups": 200, "identities": 100, "parked": 1000,
                            "ramp_s": 25.0, "window_s": 10.0, "windows": 3, "submits": 30, "revokes": 5}
TREE = ["sh", "-c", "sleep 600 & sleep 600 & wait"]  # a command whose process tree outlives a killed leader
TREE_TYPE = {"plugins.tree": {"command": TREE}, "types.tree": {"plugins": ["tree"]}}


class GatewayDaemon(Daemon):
    """A gateway node: its /v1 API at `url`, the worker protocol at `w1` (mutual TLS against the lab's CA)."""

    def __init__(self, state_dir: Path, lab: pki.Lab, **sections: dict[str, Any]) -> None:
        listen = f"127.0.0.1:{free_port()}"
        self.w1 = f"https://{listen}"
        super().__init__(state_dir, overrides={
            "node": {"id": "gateway"},
            "gateway": {"listen": listen, "cert_file": str(lab.gateway.cert), "key_file": str(lab.gateway.key),
                        "client_ca_file": str(lab.ca_file), "enroll": "auto"},
            "pool": {"task_types": []},
            **sections,
        })


def remote_worker(state_dir: Path, lab: pki.Lab, name: str, gateway: GatewayDaemon,
                  **sections: dict[str, Any]) -> Daemon:
    issued = lab.workers[name]
    return Daemon(state_dir, overrides={
        "node": {"id": name},
        "store": {"url": gateway.w1, "cert_file": str(issued.cert), "key_file": str(issued.key),
                  "ca_file": str(lab.ca_file)},
        **sections,
    })


def raise_nofile() -> str:
    """The soft limit on open files raised to the hard one: the scale row holds a socket per parked acquire in
    this process and in the gateway, which inherits the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= hard:
        return f"open files: soft limit {soft}, the hard one, here and in the gateway"
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return f"open files: soft limit {soft} raised to {hard} here and in the gateway (inherited)"


# drain


def remote_drain(state_dir: Path, lab: pki.Lab, n: int, workers: int, claim_batch: int) -> dict[str, float]:
    """Two remote workers drain the queue already in state_dir: tasks/s as the gateway's file recorded it, and
    CPU µs per task of the gateway's event loop, of its other threads, and of both workers together."""
    pool = {"min_workers": workers, "max_workers": workers, "claim_batch": claim_batch}
    gateway = GatewayDaemon(state_dir, lab)
    gateway.start(timeout_s=60)
    try:
        before = thread_cpu_s(gateway.pid)
        remotes = [remote_worker(state_dir / name, lab, name, gateway, pool=pool) for name in ("drain-a", "drain-b")]
        spent = []
        try:
            for remote in remotes:
                remote.start()
                spent.append(_cpu_s(remote.pid))
            gateway.wait_drained(poll_s=0.25, timeout_s=600)
            used = {tid: s - before.get(tid, 0.0) for tid, s in thread_cpu_s(gateway.pid).items()}
            workers_s = sum(_cpu_s(r.pid) - s for r, s in zip(remotes, spent, strict=True))
        finally:
            for remote in remotes:
                remote.stop()
    finally:
        gateway.stop()
    (completed,), = gateway.query("SELECT count(*) FROM tasks WHERE state = 'completed'")
    (first, last), = gateway.query("SELECT (SELECT min(started_at) FROM attempts), max(finished_at) FROM tasks")
    if completed != n:
        raise RuntimeError(f"remote drain: {completed} of {n} tasks completed: {gateway.log_tail()}")
    loop_s = used.pop(gateway.pid, 0.0)
    return {"remote": n / (last - first), "gw_loop_us": 1e6 * loop_s / n, "gw_others_us": 1e6 * sum(used.values()) / n,
            "workers_us": 1e6 * workers_s / n}


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def drain_rows(args: Any, lab: pki.Lab) -> list[Figure]:
    got: dict[str, list[float]] = {}
    for run in range(args.runs):
        with temp_dir("gateway-drain") as tmp:
            enqueue(tmp / "remote", args.n, args.batch)
            copy_store(tmp / "remote", tmp / "local")
            figures = remote_drain(tmp / "remote", lab, args.n, args.workers, args.claim_batch)
            figures["local"] = drain(tmp / "local", args.n, 2 * args.workers, args.claim_batch)[0]
            figures["ratio"] = figures["remote"] / figures["local"]
        for key, value in figures.items():
            got.setdefault(key, []).append(value)
        print(f"  drain run {run + 1}/{args.runs} at claim_batch {args.claim_batch}: remote {figures['remote']:,.0f}, "
              f"local {figures['local']:,.0f} tasks/s", file=sys.stderr, flush=True)
    m = {k: median(v) for k, v in got.items()}
    b, cb = "gateway", f"claim_batch {args.claim_batch} both"
    ratios = ", ".join(f"{r:.3f}" for r in got["ratio"])
    return [
        Figure(b, f"drain, 2 remote workers x {args.workers}, SQLite", m["remote"], "tasks/s",
               f"{spread(got['remote'])}; N={args.n}; {cb}; first start .. last finish"),
        Figure(b, f"drain, one local node x {2 * args.workers}, same store", m["local"], "tasks/s",
               f"{spread(got['local'])}; {cb}"),
        Figure(b, "drain, remote / local", m["remote"] / m["local"], "x",
               f"{cb}; the runs' own ratios {ratios}; the goal: at least 0.5"),
        Figure(b, "remote drain CPU per task, gateway's loop", m["gw_loop_us"], "µs", "from /proc"),
        Figure(b, "remote drain CPU per task, gateway's others", m["gw_others_us"], "µs", "SQLite writer, readers"),
        Figure(b, "remote drain CPU per task, both workers", m["workers_us"], "µs", "all their threads"),
    ]



# pickup


class StartStamps:
    """A daemon's `plugin.started` events as they come (its /v1/events stream, read in a thread): task id ->
    the daemon's own stamp of the event."""

    def __init__(self, daemon: Daemon) -> None:
        self._stamps: dict[str, float] = {}
        self._seen = threading.Condition()
        self._response = urllib.request.urlopen(daemon.url + "/v1/events?type=plugin.started", timeout=60)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for raw in self._response:
                line = raw.decode().rstrip("\n")
                if line.startswith("data: "):
                    data = json.loads(line.removeprefix("data: "))
                    with self._seen:
                        self._stamps[data["task_id"]] = ts(data["ts"])
                        self._seen.notify_all()
        except Exception:  # close() ends the stream under the reader, whatever that raises
            pass

    def wait(self, task_id: str, timeout_s: float = 10.0) -> float:
        with self._seen:
            if not self._seen.wait_for(lambda: task_id in self._stamps, timeout_s):
                raise RuntimeError(f"task {task_id} did not start within {timeout_s}s")
            return self._stamps[task_id]

    def close(self) -> None:
        self._response.close()


def pickup_rows(args: Any, lab: pki.Lab) -> list[Figure]:
    pickup, leased = [], []
    with temp_dir("gateway-pickup") as tmp:
        gateway = GatewayDaemon(tmp / "gateway", lab)
        gateway.start()
        worker = remote_worker(tmp / "worker", lab, "pickup-a", gateway)
        try:
            worker.start()
            stamps = StartStamps(worker)
            time.sleep(1.0)  # the worker's first acquires are parked: it is idle
            for _ in range(args.pickups):
                task = gateway.post("/v1/tasks", {"type": "noop"})
                answered = time.time()
                pickup.append(stamps.wait(task["id"]) - answered)
                time.sleep(0.02)  # its ending written, the worker parks again
            stamps.close()
            for task in gateway.get(f"/v1/tasks?limit={args.pickups}")["tasks"]:
                leased.append(ts(gateway.get(f"/v1/tasks/{task['id']}")["attempts"][0]["started_at"])
                              - ts(task["created_at"]))
        finally:
            worker.stop()
            gateway.stop()
    b, n = "gateway", f"n={args.pickups}"
    return [
        Figure(b, "pickup p50 (submit answered .. worker starts)", 1000 * percentile(pickup, 50), "ms", n),
        Figure(b, "pickup p99", 1000 * percentile(pickup, 99), "ms", f"{n}; the goal: at most 10 ms"),
        Figure(b, "pickup max", 1000 * max(pickup), "ms", n),
        Figure(b, "gateway's stamps, created .. leased, p50", 1000 * percentile(leased, 50), "ms", n),
        Figure(b, "gateway's stamps, created .. leased, p99", 1000 * percentile(leased, 99), "ms", n),
    ]


# scale


def scale_rows(args: Any) -> tuple[list[Figure], str]:
    nofile = raise_nofile()
    with temp_dir("gateway-scale") as tmp:
        names = [f"load-{k:03d}" for k in range(args.identities)]
        lab = pki.make_lab(tmp / "pki", workers=names)
        gateway = GatewayDaemon(tmp / "gateway", lab)
        gateway.start()
        try:
            got = asyncio.run(_scale(gateway, lab, names, args))
        finally:
            gateway.stop()
    b, per = "gateway", args.parked // args.identities
    held = f"{args.parked} acquires from {args.identities} identities"
    windows = f"median of {args.windows} x {args.window_s:g} s, max {max(got['cpu']):.2f} %"
    return [
        Figure(b, f"idle gateway CPU, {held}", median(got["cpu"]), "%", f"{windows}; the goal: under 5 %"),
        Figure(b, "idle gateway RSS, the same", got["rss"] / 2**20, "MB", "largest seen; the goal: under 300 MB"),
        Figure(b, "acquires answered a second meanwhile", got["answered"], "/s", f"{per} per identity, held 25 s"),
        Figure(b, "gateway CPU per acquire answered, event loop", got["loop_ms"], "ms", "from /proc, the windows"),
        Figure(b, "gateway CPU per acquire answered, other threads", got["others_ms"], "ms", "SQLite writer, readers"),
        Figure(b, "pickup meanwhile p50 (submit sent .. lease)", 1000 * percentile(got["pickup"], 50), "ms",
               f"n={args.submits}; by the load client"),
        Figure(b, "pickup meanwhile p99", 1000 * percentile(got["pickup"], 99), "ms",
               f"n={args.submits}; the goal: at most 50 ms"),
    ], nofile


async def _scale(gateway: GatewayDaemon, lab: pki.Lab, names: list[str], args: Any) -> dict[str, Any]:
    import aiohttp

    client = LoadClient(lab, names, gateway.w1, per_identity=args.parked // len(names))
    process = psutil.Process(gateway.pid)
    try:
        await client.start(args.ramp_s)
        await asyncio.sleep(2.0)
        if client.errors or client.in_flight < args.parked:
            raise RuntimeError(f"{client.in_flight} of {args.parked} acquires held; errors: {client.errors[:3]}")
        cpu, rss, answered, threads = [], 0, client.answered, thread_cpu_s(gateway.pid)
        started = time.perf_counter()
        for _ in range(args.windows):
            cpu.append(await cpu_percent(process, args.window_s))
            rss = max(rss, process.memory_info().rss)
        elapsed = time.perf_counter() - started
        used = {tid: s - threads.get(tid, 0.0) for tid, s in thread_cpu_s(gateway.pid).items()}
        answered = client.answered - answered
        loop_s, others_s = used.pop(gateway.pid, 0.0), sum(used.values())
        pickup = []
        async with aiohttp.ClientSession() as api:
            for _ in range(args.submits):
                sent = time.perf_counter()
                async with api.post(gateway.url + "/v1/tasks", json={"type": "noop"}) as r:
                    task_id = (await r.json())["id"]
                pickup.append(await client.pickups.wait(task_id, 10.0) - sent)
                await asyncio.sleep(0.2)
        if client.errors:
            raise RuntimeError(f"load client: {len(client.errors)} acquires failed: {client.errors[:3]}")
        return {"cpu": cpu, "rss": rss, "answered": answered / elapsed, "pickup": pickup,
                "loop_ms": 1000 * loop_s / max(1, answered), "others_ms": 1000 * others_s / max(1, answered)}
    finally:
        await client.close()


# revoke


def revoke_rows(args: Any, lab: pki.Lab) -> list[Figure]:
    gone_s, cancelled_s = [], []
    with temp_dir("gateway-revoke") as tmp:
        gateway = GatewayDaemon(tmp / "gateway", lab, **TREE_TYPE)
        gateway.start()
        try:
            for k in range(args.revokes):
                name = f"revoke-{k}"
                worker = remote_worker(tmp / name, lab, name, gateway, **TREE_TYPE)
                worker.start()
                try:
                    tree_gone, cancelled = _revoke_once(gateway, worker, name)
                finally:
                    worker.stop()
                gone_s.append(tree_gone)
                cancelled_s.append(cancelled)
        finally:
            gateway.stop()
    b, n = "gateway", f"n={args.revokes}, max {1000 * max(max(gone_s), max(cancelled_s)):.0f} ms"
    return [
        Figure(b, "revoke .. command's tree gone, median", 1000 * statistics.median(gone_s), "ms", n),
        Figure(b, "revoke .. task cancelled, median", 1000 * statistics.median(cancelled_s), "ms",
               f"{n}; the goal: at most 1 s"),
    ]


def _revoke_once(gateway: GatewayDaemon, worker: Daemon, name: str) -> tuple[float, float]:
    """Seconds from the revoke's answer to the command's processes all gone, and to the task `cancelled`."""
    task_id = gateway.post("/v1/tasks", {"type": "tree"})["id"]
    tree = _wait(lambda: [p for p in psutil.Process(worker.pid).children(recursive=True)
                          if p.name() == "sleep"], "the command's two sleeps", at_least=2)
    tree += [p.parent() for p in tree[:1]]  # the shell
    _wait(lambda: gateway.get(f"/v1/tasks/{task_id}")["state"] == "running", "the task running")
    revoked = time.perf_counter()
    gateway.post(f"/v1/workers/{name}/revoke", {})
    tree_gone = cancelled = None
    while tree_gone is None or cancelled is None:
        now = time.perf_counter() - revoked
        if now > 30:
            state = gateway.get(f"/v1/tasks/{task_id}")["state"]
            raise RuntimeError(f"revoke of {name}: tree gone after {tree_gone} s, task {task_id} {state} after 30 s\n"
                               f"{worker.log_tail()}\n{gateway.log_tail()}")
        if tree_gone is None and all(_gone(p) for p in tree):
            tree_gone = now
        if cancelled is None and gateway.get(f"/v1/tasks/{task_id}")["state"] == "cancelled":
            cancelled = now
        time.sleep(0.002)
    return tree_gone, cancelled


def _gone(process: psutil.Process) -> bool:
    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _wait(condition: Any, what: str, *, at_least: int = 1, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with_value = condition()
        if (len(with_value) >= at_least) if isinstance(with_value, list) else with_value:
            return with_value
        time.sleep(0.01)
    raise RuntimeError(f"not within {timeout_s}s: {what}")


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    rows = set(args.rows.split(","))
    figures: list[Figure] = []
    notes = [f"durable figures: {fsync_note()}"]
    with temp_dir("gateway-pki") as tmp:
        names = ["drain-a", "drain-b", "pickup-a", *(f"revoke-{k}" for k in range(args.revokes))]
        lab = pki.make_lab(tmp / "pki", workers=names)
        if "drain" in rows:
            figures += drain_rows(args, lab)
        if "pickup" in rows:
            figures += pickup_rows(args, lab)
        if "scale" in rows:
            scale, nofile = scale_rows(args)
            figures += scale
            notes.append(nofile)
        if "revoke" in rows:
            figures += revoke_rows(args, lab)
    report("gateway: remote workers over mutual TLS, SQLite store, shipped defaults", figures,
           reproduce("gateway.py", args, DEFAULTS), args.summary, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
