"""The gateway fleet: many idle worker identities held on one gateway, each a parked acquire and a control stream.

A gateway (the shipped configuration but for its listener, files, `enroll = "auto"` and a pool that takes
no type; `gateway.max_connections` only when --max-connections is set) is held by a load client of its
own: --identities worker identities, each with its own client certificate of one lab CA (made for this
run in a temporary directory, --processes at once), split over --processes client processes (one process
holds two sockets per identity; each raises its open-file limit as far as it may). Each identity opens a
`/w1/control` stream and a keep-alive connection on which it parks `/w1/acquire` (one noop task, the
25 s wait a remote worker asks, clipped to the gateway's max_wait_s) and asks again when answered; a
lease it is handed is ended at once (`succeeded`). The identities are opened at an even pace over
--ramp-s, so that, as in a fleet, their acquires come back at their own times. A connection the gateway
cuts is counted and not opened again: the figures say what was held, not what was asked.

Once every identity has opened and each of its connections is made (TLS done) or failed, after --settle-s:
  held     the TCP connections established on the gateway's listener (its sockets, from /proc), beside
           the 2 x --identities asked and what the load client still holds;
  cpu/rss  the gateway's CPU (all threads, % of one core) over --windows windows of --window-s, its RSS;
  pickup   --submits noop tasks submitted one at a time to the gateway's API meanwhile: submit sent ..
           lease received by whichever identity's acquire took it (wall clock, same machine);
  stop     the ERROR lines the gateway logged when the load client's connections all went at once.
Figures only: nothing here passes or fails on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import ssl
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from _harness import Figure, HttpError, arguments, fsync_note, median, percentile, report, reproduce, temp_dir
from gateway import GatewayDaemon
from tidepool.gateway import pki

DEFAULTS: dict[str, Any] = {"identities": 10_000, "processes": 4, "ramp_s": 60.0, "settle_s": 5.0,
                            "window_s": 10.0, "windows": 3, "submits": 50, "max_connections": -1}
UNIT_NOFILE = 65_536  # systemd/tidepool.service's LimitNOFILE: what a gateway gets where it is installed
PARK_S = 25.0  # what a remote worker asks of the gateway
HERE = Path(__file__).resolve()


def raise_nofile(want: int = UNIT_NOFILE) -> str:
    """The open-file limit raised to `want` (the unit's) where this process may raise its hard limit (root),
    else the soft one to the hard one; the gateway and the client processes inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        if hard < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    new_soft, new_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if new_soft < new_hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_hard, new_hard))
        new_soft = new_hard
    return f"open files: soft {soft} / hard {hard} raised to {new_soft} / {new_hard} (inherited by the gateway)"


# certificates


def _issue_range(directory: str, names: list[str]) -> None:
    for name in names:
        pki.issue(Path(directory), name)


def make_identities(directory: Path, count: int, processes: int) -> tuple[pki.Lab, list[str], float]:
    """A lab CA and the gateway's certificate, then `count` worker certificates made by `processes` processes
    at once; (the lab without its workers, their names, seconds it took)."""
    started = time.perf_counter()
    lab = pki.init(directory)
    names = [f"fleet-{k:05d}" for k in range(count)]
    chunks = [names[k::processes] for k in range(processes)]
    with ProcessPoolExecutor(processes) as pool:
        for done in [pool.submit(_issue_range, str(directory), chunk) for chunk in chunks]:
            done.result()
    return lab, names, time.perf_counter() - started


# the load client's processes (`gateway_fleet.py hold ...`)


class Holder:
    """One client process's identities: their control streams and parked acquires, counted."""

    def __init__(self, lab_dir: Path, w1: str, names: list[str]) -> None:
        host, port = w1.removeprefix("https://").rsplit(":", 1)
        self.host, self.port, self.lab_dir, self.names = host, int(port), lab_dir, names
        self.streams = self.parked = self.answered = 0
        self.connected = self.unconnected = self.dropped = 0  # handshakes done / failed, connections lost after
        self.errors: list[str] = []
        self.opened = 0

    def _context(self, name: str) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(pki.ca_files(self.lab_dir).cert))
        issued = pki.worker_files(self.lab_dir, name)
        context.load_cert_chain(str(issued.cert), str(issued.key))
        return context

    async def run(self, ramp_s: float) -> None:
        started = time.perf_counter()
        tasks = []
        for k, name in enumerate(self.names):
            delay = started + ramp_s * k / len(self.names) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            context = self._context(name)
            tasks += [asyncio.create_task(self._control(context)), asyncio.create_task(self._acquires(context))]
            self.opened += 1
        _emit({"opened": self.opened})
        await asyncio.gather(*tasks)

    async def _connect(self, context: ssl.SSLContext) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            got = await asyncio.open_connection(self.host, self.port, ssl=context, server_hostname=self.host)
        except Exception:
            self.unconnected += 1
            raise
        self.connected += 1
        return got

    async def _control(self, context: ssl.SSLContext) -> None:
        try:
            reader, writer = await self._connect(context)
            writer.write(f"GET /w1/control HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
            status = await reader.readline()
            if b" 200 " not in status:
                raise RuntimeError(f"control stream answered {status.decode(errors='replace').strip()}")
            self.streams += 1
            try:
                while await reader.read(4096):
                    pass
            finally:
                self.streams -= 1
            self._lost("control stream closed by the gateway")
        except Exception as exc:  # counted and kept; this identity's stream stops
            self._lost(f"control: {type(exc).__name__}: {exc}")

    async def _acquires(self, context: ssl.SSLContext) -> None:
        try:
            reader, writer = await self._connect(context)
            while True:
                body = {"types": ["noop"], "max": 1, "wait_s": PARK_S, "request_id": uuid.uuid4().hex}
                self.parked += 1
                try:
                    status, answer = await _post(reader, writer, self.host, "/w1/acquire", body)
                finally:
                    self.parked -= 1
                self.answered += 1
                if status != 200:
                    raise RuntimeError(f"acquire answered {status}: {answer}")
                for lease in answer["tasks"]:
                    _emit({"leased": lease["task"]["id"], "at": time.time()})
                    ending = {"attempt_id": lease["attempt_id"], "lease_token": lease["lease_token"],
                              "status": "succeeded"}
                    status, answer = await _post(reader, writer, self.host, "/w1/finish", {"endings": [ending]})
                    if status != 200:
                        raise RuntimeError(f"finish answered {status}: {answer}")
        except Exception as exc:  # counted and kept; this identity's acquires stop
            self._lost(f"acquire: {type(exc).__name__}: {exc}")

    def _lost(self, why: str) -> None:
        self.dropped += 1
        if len(self.errors) < 3:
            self.errors.append(why[:200])

    async def report_every(self, period_s: float) -> None:
        while True:
            _emit({"streams": self.streams, "parked": self.parked, "answered": self.answered,
                   "connected": self.connected, "unconnected": self.unconnected,
                   "dropped": self.dropped - self.unconnected, "opened": self.opened, "errors": self.errors})
            await asyncio.sleep(period_s)


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, path: str,
                body: Any) -> tuple[int, Any]:
    """One keep-alive HTTP/1.1 POST of JSON; (status, the JSON answer). The gateway answers with a length."""
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    raw = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), json.loads(raw or b"null")


def _emit(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


async def hold(lab_dir: Path, w1: str, names: list[str], ramp_s: float) -> None:
    holder = Holder(lab_dir, w1, names)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(holder.report_every(1.0))
        tg.create_task(holder.run(ramp_s))


# the bench's own process


class Clients:
    """The load client's processes, their latest counts and the leases they were handed (task id -> wall time)."""

    def __init__(self, lab_dir: Path, w1: str, names: list[str], processes: int, ramp_s: float) -> None:
        self.counts: dict[int, dict[str, Any]] = {}
        self.leased: dict[str, float] = {}
        self._seen = threading.Condition()
        self.procs = []
        for k in range(processes):
            share = names[k::processes]
            command = [sys.executable, str(HERE), "hold", str(lab_dir), w1, str(ramp_s), *share]
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(k, proc), daemon=True).start()

    def _read(self, k: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            message = json.loads(line)
            with self._seen:
                if "leased" in message:
                    self.leased[message["leased"]] = message["at"]
                else:
                    self.counts.setdefault(k, {}).update(message)
                self._seen.notify_all()

    def total(self, key: str) -> int:
        with self._seen:
            return sum(int(c.get(key, 0)) for c in self.counts.values())

    def errors(self) -> list[str]:
        with self._seen:
            return [e for c in self.counts.values() for e in c.get("errors", [])]

    def wait_opened(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.total("opened") < count:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                codes = [p.poll() for p in self.procs]
                raise RuntimeError(f"{self.total('opened')} of {count} identities opened; clients {codes}")
            time.sleep(0.5)

    def wait_settled(self, count: int, timeout_s: float) -> float:
        """Wait until `count` connections have each been made or failed (handshakes queue at a busy gateway);
        the seconds it took. Raises past timeout_s, saying how many were still pending."""
        started = time.monotonic()
        while (done := self.total("connected") + self.total("unconnected")) < count:
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"{count - done:,} of {count:,} connections neither made nor failed after "
                                   f"{timeout_s:g} s")
            time.sleep(0.5)
        return time.monotonic() - started

    def wait_leased(self, task_id: str, timeout_s: float) -> float | None:
        with self._seen:
            self._seen.wait_for(lambda: task_id in self.leased, timeout_s)
            return self.leased.get(task_id)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def gateway_connections(pid: int, port: int) -> int:
    """TCP connections established on the gateway's listener, as its process holds them."""
    held = psutil.Process(pid).net_connections(kind="tcp")
    return sum(1 for c in held if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)


def measure(gateway: GatewayDaemon, clients: Clients, args: Any) -> dict[str, Any]:
    process, port = psutil.Process(gateway.pid), int(gateway.w1.rsplit(":", 1)[1])
    got: dict[str, Any] = {"cpu": [], "rss": 0, "held": [], "answered": clients.total("answered")}
    started = time.perf_counter()
    for _ in range(args.windows):
        before, t0 = process.cpu_times(), time.perf_counter()
        time.sleep(args.window_s)
        after, elapsed = process.cpu_times(), time.perf_counter() - t0
        got["cpu"].append(100 * (after.user - before.user + after.system - before.system) / elapsed)
        got["rss"] = max(got["rss"], process.memory_info().rss)
        got["held"].append(gateway_connections(gateway.pid, port))
    got["answered"] = (clients.total("answered") - got["answered"]) / (time.perf_counter() - started)
    for key in ("streams", "parked", "connected", "unconnected", "dropped"):
        got[key] = clients.total(key)
    got["pickup"], got["missed"] = [], 0
    for _ in range(args.submits):
        sent = time.time()
        task_id = gateway.post("/v1/tasks", {"type": "noop"})["id"]
        leased = clients.wait_leased(task_id, 10.0)
        if leased is None:
            got["missed"] += 1
        else:
            got["pickup"].append(leased - sent)
        time.sleep(0.1)
    return got


def log_lines(gateway: GatewayDaemon, word: str) -> int:
    """Lines of the gateway's log holding `word` so far."""
    with contextlib.suppress(OSError):
        return sum(1 for line in gateway.log_path.read_text(errors="replace").splitlines() if word in line)
    return 0


def run(args: Any) -> tuple[list[Figure], list[str]]:
    nofile = raise_nofile()
    with temp_dir("gateway-fleet") as tmp:
        lab, names, made_s = make_identities(tmp / "pki", args.identities, max(2, os.cpu_count() or 2))
        sections = {} if args.max_connections < 0 else {"gateway": {"max_connections": args.max_connections}}
        gateway = GatewayDaemon(tmp / "gateway", lab)
        if sections:
            gateway.config_path.write_text(gateway.config_path.read_text().replace(
                "[gateway]\n", f"[gateway]\nmax_connections = {args.max_connections}\n"))
        gateway.start(timeout_s=60)
        clients = None
        try:
            clients = Clients(lab.dir, gateway.w1, names, args.processes, args.ramp_s)
            clients.wait_opened(args.identities, args.ramp_s + 120)
            settled_s = clients.wait_settled(2 * args.identities, 300.0)
            time.sleep(args.settle_s)
            got = measure(gateway, clients, args)
            errors = clients.errors()
            got["full"] = log_lines(gateway, "connections are open")
            before_stop = log_lines(gateway, " ERROR ")
            clients.stop()
            time.sleep(2.0)
            got["errors_at_stop"] = log_lines(gateway, " ERROR ") - before_stop
        finally:
            if clients is not None:
                clients.stop()
            with contextlib.suppress(HttpError, OSError):
                gateway.stop()
    return figures(args, got), [nofile, f"{args.identities:,} certificates made in {made_s:.1f} s",
                                f"every connection made or failed {settled_s:.1f} s after the ramp's end",
                                *(f"load client: {e}" for e in errors[:3])]


def figures(args: Any, got: dict[str, Any]) -> list[Figure]:
    b, asked = "fleet", 2 * args.identities
    held = median(got["held"])
    cap = "shipped" if args.max_connections < 0 else f"{args.max_connections} (0: sized from open files)"
    windows = f"median of {args.windows} x {args.window_s:g} s, {min(got['cpu']):.1f}-{max(got['cpu']):.1f} %"
    picked, n = got["pickup"], args.submits
    p99 = 1000 * percentile(picked, 99) if picked else float("nan")
    p50 = 1000 * percentile(picked, 50) if picked else float("nan")
    return [
        Figure(b, f"gateway's connections, {args.identities:,} identities", held, "conns",
               f"{held:,.0f} of {asked:,} held; gateway.max_connections {cap}; "
               f"{got['full']} 'connections are open' warnings in its log"),
        Figure(b, "control streams the load client holds", got["streams"], "streams",
               f"{got['parked']:,} acquires parked; of {asked:,} connections {got['connected']:,} made (TLS done), "
               f"{got['unconnected']:,} not, {got['dropped']:,} cut after"),
        Figure(b, "gateway CPU while holding them", median(got["cpu"]), "%",
               f"{windows}; of one core; the goal: at most 5 %"),
        Figure(b, "gateway RSS while holding them", got["rss"] / 2**20, "MiB", "largest seen; the goal: at most 1 GiB"),
        Figure(b, "acquires answered a second meanwhile", got["answered"], "/s", "empty ones, parked again"),
        Figure(b, f"pickup of {n} tasks meanwhile, p50", p50, "ms", "submit sent .. lease received"),
        Figure(b, f"pickup of {n} tasks meanwhile, p99", p99, "ms",
               f"{len(picked)} of {n} picked up within 10 s; the goal: at most 10 ms"),
        Figure(b, "gateway's ERROR lines as the load stopped", got["errors_at_stop"], "lines",
               "all the client's connections closed at once"),
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hold"]:  # a load client process, started by Clients
        lab_dir, w1, ramp_s, *names = argv[1:]
        raise_nofile()
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        asyncio.run(hold(Path(lab_dir), w1, names, float(ramp_s)))
        return 0
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    found, notes = run(args)
    report("gateway fleet: idle identities held on one gateway, SQLite store, shipped defaults (one run)", found,
           reproduce("gateway_fleet.py", args, DEFAULTS), args.summary, [*notes, f"durable figures: {fsync_note()}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
