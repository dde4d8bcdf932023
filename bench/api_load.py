"""API load: many concurrent HTTP clients submitting, and SSE subscribers that must miss nothing.

submit  one daemon (default pool: 2..16 workers); --clients aiohttp clients, each with its own session
        and connection, submit --tasks noop tasks in total with POST /v1/tasks, one at a time each.
        Every POST must answer 201 and every task must end completed (checked in the SQLite file).
        Latency is the client-side POST round trip; "accepted/s" is tasks / (first POST .. last 201).
        --tasks 0 leaves this part out.
sse     a fresh daemon per run; --subscribers raw HTTP/1.1 readers follow GET /v1/events (unfiltered), then
        --sse-tasks noop tasks go in as one batch. Each subscriber must receive every event of every
        task: a contiguous run of event ids (no gap, no repeat) and, per task, the nine events of a
        noop task in order. Drain throughput = tasks / (first attempt start .. last finish), both
        stamped by the daemon; each round runs with and without subscribers back to back, and the
        ratio is the median of the rounds' own ratios (--runs rounds). The subscribers run in this
        process, on the same CPUs as the daemon. The daemon's CPU (user + system, submit .. drained) is
        given per 1,000 tasks, with and without subscribers, and what the subscribers add as the median
        of the rounds' own differences. A third run of each round has --subscribers streams filtered on
        other tasks' ids (waiting clients). --against SRC compares this tree's daemon with the one in
        another checkout's src/ instead, their drains interleaved (see bench_against).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from _harness import (
    Daemon,
    Figure,
    arguments,
    fsync_note,
    median,
    percentile,
    report,
    reproduce,
    spread,
    temp_dir,
)

DEFAULTS: dict[str, Any] = {"clients": 200, "tasks": 10_000, "subscribers": 20, "sse_tasks": 1000, "runs": 7,
                            "against": ""}
NOOP_EVENTS = ("task.created", "task.leased", "task.phase", "task.phase", "task.phase", "plugin.started",
               "plugin.finished", "task.phase", "task.finished")


# submit load


async def submit_load(daemon: Daemon, clients: int, tasks: int) -> tuple[list[float], float, int]:
    """(POST latencies in s, seconds from the first POST to the last answer, non-201 answers)."""
    per_client = [tasks // clients + (1 if i < tasks % clients else 0) for i in range(clients)]
    latencies: list[float] = []
    refused = 0

    async def client(n: int) -> None:
        nonlocal refused
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            for _ in range(n):
                before = time.perf_counter()
                async with session.post(f"{daemon.url}/v1/tasks", json={"type": "noop"}) as r:
                    await r.read()
                    latencies.append(time.perf_counter() - before)
                    refused += r.status != 201

    started = time.perf_counter()
    await asyncio.gather(*(client(n) for n in per_client))
    return latencies, time.perf_counter() - started, refused


def bench_submit(root: Path, clients: int, tasks: int) -> list[Figure]:
    daemon = Daemon(root / "submit")
    daemon.start()
    try:
        first_post = time.monotonic()
        latencies, elapsed, refused = asyncio.run(submit_load(daemon, clients, tasks))
        finished = daemon.wait_drained(poll_s=0.1, timeout_s=600) - first_post
    finally:
        code = daemon.stop()
    (completed,), = daemon.query("SELECT count(*) FROM tasks WHERE state = 'completed'")
    (stored,), = daemon.query("SELECT count(*) FROM tasks")
    if code != 0 or refused or completed != tasks or stored != tasks:
        raise RuntimeError(f"submit: exit {code}, {refused} refused, {stored} stored, {completed} of {tasks} "
                           f"completed: {daemon.log_tail()}")
    b, note = "api_load", f"one run; {clients} clients, n={tasks}"
    return [
        Figure(b, "submit: accepted (201) and completed", completed, "tasks", f"of {tasks}, none refused"),
        Figure(b, "submit: accepted/s (first POST .. last 201)", tasks / elapsed, "tasks/s", note),
        Figure(b, "submit: POST latency p50", 1000 * percentile(latencies, 50), "ms", note),
        Figure(b, "submit: POST latency p99", 1000 * percentile(latencies, 99), "ms", note),
        Figure(b, "submit: POST latency max", 1000 * max(latencies), "ms", note),
        Figure(b, "submit: first POST .. all completed seen", finished, "s", note),
    ]


# SSE fan-out


def dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body (as far as it arrived)."""
    out, at = [], 0
    while (eol := body.find(b"\r\n", at)) != -1:
        size = int(body[at:eol].split(b";")[0], 16)
        if size == 0:
            break
        out.append(body[eol + 2:eol + 2 + size])  # the last chunk may have arrived in part
        at = eol + 2 + size + 2
    return b"".join(out)


class Subscriber:
    """Reads the raw stream over a plain socket; each event's id and (name, task_id) are taken from it
    once every subscriber has read everything.

    While the daemon drains, a subscriber only keeps the bytes and counts finished tasks with bytes
    methods (C speed): it is the measuring instrument and shares the daemon's two cores. Parsing the
    180,000 frames in Python as they arrived cost ~2.7 s of CPU, which measured the clients more than
    the daemon; reading the socket directly, 20 subscribers use ~0.1 s while 1,000 tasks drain.
    """

    FINISHED = b"event: task.finished\n"

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.by_task: dict[str, list[str]] = {}
        self.finished = 0
        self.connected = asyncio.Event()
        self.body: list[bytes] = []

    async def follow(self, url: str, tasks: int) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(f"GET /v1/events HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200") or b"transfer-encoding: chunked" not in head.lower():
                raise RuntimeError(f"GET /v1/events answered {head!r}")
            pending = b""
            while self.finished < tasks:
                data = await reader.read(1 << 20)
                if not data:
                    raise RuntimeError("the event stream ended early")
                self.body.append(data)
                # Every chunk holds whole frames, so a marker is never split by chunk framing; only a
                # read can split it, hence the carried tail.
                complete, _, pending = (pending + data).rpartition(b"\n\n")
                self.finished += complete.count(self.FINISHED)
                if not self.connected.is_set() and b": connected" in complete:
                    self.connected.set()
        finally:
            writer.close()

    def parse(self) -> None:
        """After the drain: read every frame's id, name and task."""
        for frame in dechunk(b"".join(self.body)).split(b"\n\n"):
            self.take(frame)

    def take(self, frame: bytes) -> None:
        fields = dict(line.split(b": ", 1) for line in frame.split(b"\n") if b": " in line and line[:1] != b":")
        if b"id" not in fields:
            return
        self.ids.append(int(fields[b"id"]))
        name = fields[b"event"].decode()
        task_id = json.loads(fields[b"data"]).get("task_id")
        if task_id is not None:
            self.by_task.setdefault(task_id, []).append(name)

    def problems(self, ids: list[str]) -> list[str]:
        found = []
        if self.ids != list(range(self.ids[0], self.ids[0] + len(self.ids))):
            found.append("event ids are not contiguous")
        missing = [t for t in ids if tuple(self.by_task.get(t, ())) != NOOP_EVENTS]
        if missing:
            found.append(f"{len(missing)} tasks without their nine events in order")
        return found


async def sse_run(daemon: Daemon, subscribers: int, tasks: int) -> tuple[int, float, int]:
    """Subscribers connect, the batch goes in, all must see everything: (the number of events each got,
    this process's CPU seconds from the submit until every subscriber had read everything, the bytes each
    read)."""
    subs = [Subscriber() for _ in range(subscribers)]
    followers = [asyncio.create_task(s.follow(daemon.url, tasks)) for s in subs]
    await asyncio.wait_for(asyncio.gather(*(s.connected.wait() for s in subs)), 10)
    own_before = time.process_time()
    async with aiohttp.ClientSession() as session, \
            session.post(f"{daemon.url}/v1/tasks/batch", json={"tasks": [{"type": "noop"}] * tasks}) as r:
        ids: list[str] = (await r.json())["ids"]
    await asyncio.to_thread(daemon.wait_drained, poll_s=0.05, timeout_s=300)  # polled as in every run
    await asyncio.wait_for(asyncio.gather(*followers), 300)
    own = time.process_time() - own_before
    for sub in subs:  # once all have read everything: parsing must not slow a reader still reading
        sub.parse()
    for i, sub in enumerate(subs):
        if problems := sub.problems(ids):
            raise RuntimeError(f"subscriber {i}: {'; '.join(problems)}")
    return (len(subs[0].ids) if subs else 0), own, (sum(map(len, subs[0].body)) if subs else 0)


async def followers_run(daemon: Daemon, followers: int, tasks: int) -> list[str]:
    """`followers` streams filtered on a task of their own (as `tidepool submit --wait` follows one),
    none of them in the batch (theirs ran before it): what waiting clients cost a pool busy with other
    work."""
    host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
    waiting = await asyncio.to_thread(daemon.submit_batch, [{"type": "noop"}] * followers)
    await asyncio.to_thread(daemon.wait_drained, poll_s=0.05, timeout_s=300)
    streams = []
    for task_id in waiting:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /v1/events?task_id={task_id} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        await reader.readuntil(b": connected\n\n")
        streams.append(writer)
    try:
        await asyncio.to_thread(daemon.submit_batch, [{"type": "noop"}] * tasks)
        await asyncio.to_thread(daemon.wait_drained, poll_s=0.05, timeout_s=300)
    finally:
        for writer in streams:
            writer.close()
    return waiting


Drain = tuple[float, int, float, float, int]


def drain_once(root: Path, subscribers: int, tasks: int, *, filtered: bool = False,
               env: Mapping[str, str] | None = None) -> Drain:
    """(drain tasks/s from the daemon's own stamps, events each subscriber received, the daemon's CPU
    seconds from the submit to the end of the drain, the subscribers' CPU seconds while they read, the
    bytes each subscriber read)."""
    daemon = Daemon(root, env=env)
    daemon.start()
    try:
        proc = psutil.Process(daemon.pid)
        cpu_before = sum(proc.cpu_times()[:2])
        events, own, received, followed = 0, 0.0, 0, []
        if subscribers and filtered:
            followed = asyncio.run(followers_run(daemon, subscribers, tasks))
        elif subscribers:
            events, own, received = asyncio.run(sse_run(daemon, subscribers, tasks))
        else:
            daemon.submit_batch([{"type": "noop"}] * tasks)
            daemon.wait_drained(poll_s=0.05, timeout_s=300)
        cpu = sum(proc.cpu_times()[:2]) - cpu_before
    finally:
        daemon.stop()
    others = ",".join("?" * len(followed))  # the followed tasks ran before the batch: not part of its drain
    (completed,), = daemon.query(f"SELECT count(*) FROM tasks WHERE state = 'completed' AND id NOT IN ({others})",
                                 followed)
    (first, last), = daemon.query(f"SELECT (SELECT min(started_at) FROM attempts WHERE task_id NOT IN ({others})), "
                                  f"max(finished_at) FROM tasks WHERE id NOT IN ({others})", followed * 2)
    if completed != tasks:
        raise RuntimeError(f"sse: {completed} of {tasks} completed: {daemon.log_tail()}")
    return tasks / (last - first), events, cpu, own, received


def paired(with_subs: list[Drain], without: list[Drain], tasks: int) -> tuple[list[float], list[float]]:
    """Each round's drain ratio with / without subscribers, and the daemon CPU they added per 1,000 tasks,
    each sorted. Each round's runs are seconds apart while this machine's speed drifts over minutes: a
    round's own figures compare like with like, and their median is the figure."""
    pairs = list(zip(with_subs, without, strict=True))
    return (sorted(w[0] / wo[0] for w, wo in pairs), sorted((w[2] - wo[2]) * 1000 / tasks for w, wo in pairs))


def bench_sse(root: Path, subscribers: int, tasks: int, runs: int) -> list[Figure]:
    with_subs, followed, without, events = [], [], [], 0
    for run in range(runs):
        with_subs.append(drain_once(root / f"sse-{run}", subscribers, tasks))
        events = with_subs[-1][1]
        without.append(drain_once(root / f"plain-{run}", 0, tasks))
        followed.append(drain_once(root / f"followed-{run}", subscribers, tasks, filtered=True))
    b = "api_load"
    note = f"median of {runs}, n={tasks}"
    rate_with, rate_without = median([r[0] for r in with_subs]), median([r[0] for r in without])
    ratios, extra_cpu = paired(with_subs, without, tasks)
    followed_ratios, _ = paired(followed, without, tasks)

    def per_1000(cpu_s: Iterable[float]) -> float:
        return median([s * 1000 / tasks for s in cpu_s])

    return [
        Figure(b, f"sse: events each of {subscribers} subscribers got", events, "events",
               f"{tasks} tasks, all present, ids contiguous"),
        Figure(b, "sse: bytes each subscriber read", median([r[4] for r in with_subs]) * 1000 / tasks, "bytes",
               "per 1,000 tasks, HTTP chunks included"),
        Figure(b, f"sse: drain with {subscribers} subscribers", rate_with, "tasks/s",
               f"{spread([r[0] for r in with_subs])}, n={tasks}"),
        Figure(b, "sse: drain without subscribers", rate_without, "tasks/s",
               f"{spread([r[0] for r in without])}, n={tasks}"),
        Figure(b, "sse: drain ratio with / without", median(ratios), "x",
               f"median of each round's ratio ({ratios[0]:.2f}-{ratios[-1]:.2f}); 1.0 = subscribers cost nothing"),
        Figure(b, f"sse: daemon CPU with {subscribers} subscribers", per_1000(r[2] for r in with_subs), "s",
               f"per 1,000 tasks, submit .. drained, {note}"),
        Figure(b, "sse: daemon CPU without subscribers", per_1000(r[2] for r in without), "s",
               f"per 1,000 tasks, submit .. drained, {note}"),
        Figure(b, f"sse: daemon CPU {subscribers} subscribers add", round(median(extra_cpu), 3), "s",
               f"per 1,000 tasks; median of each round's own difference ({extra_cpu[0]:.3f}-{extra_cpu[-1]:.3f} s)"),
        Figure(b, "sse: the subscribers' own CPU while reading", median([r[3] for r in with_subs]), "s",
               "this process, submit .. all read; competes with the daemon for the same cores"),
        Figure(b, f"sse: drain with {subscribers} task-filtered followers / without", median(followed_ratios), "x",
               f"each follows a task not in the batch; median of each round's ratio "
               f"({followed_ratios[0]:.2f}-{followed_ratios[-1]:.2f})"),
    ]


def bench_against(root: Path, subscribers: int, tasks: int, runs: int, against: str) -> list[Figure]:
    """--against SRC: the drain with and without subscribers, of this tree's daemon and of the one whose
    package is in SRC (another checkout's src/, first on the daemon's PYTHONPATH); the four drains of a
    round go in an order that rotates from round to round."""
    plan = [(tree, subs) for tree in ("this", "against") for subs in (subscribers, 0)]
    drains: dict[tuple[str, int], list[Drain]] = {key: [] for key in plan}
    for run in range(runs):
        for tree, subs in plan[run % 4:] + plan[:run % 4]:
            env = {"PYTHONPATH": against} if tree == "against" else {}
            drains[tree, subs].append(drain_once(root / f"{tree}-{subs}-{run}", subs, tasks, env=env))
    figures = []
    for tree in ("this", "against"):
        ratios, extra_cpu = paired(drains[tree, subscribers], drains[tree, 0], tasks)
        figures += [
            Figure("api_load", f"sse {tree}: drain ratio with / without", median(ratios), "x",
                   f"median of {runs} rounds' own ratios ({ratios[0]:.2f}-{ratios[-1]:.2f})"),
            Figure("api_load", f"sse {tree}: daemon CPU without subscribers",
                   median([d[2] for d in drains[tree, 0]]) * 1000 / tasks, "s", "per 1,000 tasks"),
            Figure("api_load", f"sse {tree}: daemon CPU {subscribers} subscribers add", round(median(extra_cpu), 3),
                   "s", f"per 1,000 tasks; median of the rounds' own ({extra_cpu[0]:.3f}-{extra_cpu[-1]:.3f} s)"),
            Figure("api_load", f"sse {tree}: bytes each subscriber read",
                   median([d[4] for d in drains[tree, subscribers]]) * 1000 / tasks, "bytes", "per 1,000 tasks"),
        ]
    return figures


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    with temp_dir("api-load") as tmp:
        started = time.monotonic()
        figures = bench_submit(tmp, args.clients, args.tasks) if args.tasks else []  # --tasks 0: SSE only
        submit_s = time.monotonic() - started
        if args.against:
            figures += bench_against(tmp, args.subscribers, args.sse_tasks, args.runs, args.against)
        else:
            figures += bench_sse(tmp, args.subscribers, args.sse_tasks, args.runs)
    report(f"api_load: {args.clients} HTTP clients x {args.tasks} submits; {args.subscribers} SSE subscribers",
           figures, reproduce("api_load.py", args, DEFAULTS), args.summary,
           [f"durable figures: {fsync_note()}", f"submit part took {submit_s:.0f}s including start and drain",
            "clients, subscribers and the daemon share this machine's CPUs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
