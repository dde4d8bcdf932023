"""A fleet on PostgreSQL: real daemons as subprocesses sharing one fresh schema of the test server.

Each test gets its own schema (`store.url = "postgresql://…?schema=e2e_<hex>"`), dropped afterwards.
What is checked is read from the store behind the daemons' backs: every task ends once, attempts of
one task never overlap in time (no moment with two live leases), a dead, frozen or cut-off node's
leases expire and its late writes are rejected by the fence, and the registry shows who is alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import pytest

from tidepool.client import Client

from ..conftest import POSTGRES_URL
from .api_helpers import NUL_REQUESTS
from .conftest import TOKEN, free_port
from .pg_fleet import Fleet

pytestmark = pytest.mark.e2e

# the tests


def test_three_nodes_run_600_tasks_each_exactly_once_and_list_each_other(fleet: Fleet) -> None:
    a, b, c = (fleet.add(n) for n in ("a", "b", "c"))
    fleet.start(a, b, c)
    assert fleet.nodes(a) == {"a": True, "b": True, "c": True}

    ids = fleet.submit("append", 600, via=[a, b, c])
    fleet.wait("600 tasks completed", lambda: fleet.completed(ids), timeout_s=60)

    recorded = Counter(fleet.lines(fleet.done_file))
    assert set(recorded) == set(ids)
    assert [i for i, n in recorded.items() if n != 1] == [], "a task ran more than once without any crash"
    per_node = dict(fleet.q("SELECT node_id, count(*) FROM attempts WHERE status = 'succeeded' GROUP BY node_id"))
    assert sum(per_node.values()) == 600 and set(per_node) == {"a", "b", "c"}, per_node
    (attempts,), = fleet.q("SELECT count(*) FROM attempts")
    assert attempts == 600
    fleet.assert_no_overlapping_attempts()
    for d in (a, b, c):
        assert fleet.nodes(d) == {"a": True, "b": True, "c": True}
    tidepool = [sys.executable, "-m", "tidepool", "nodes", "--url", b.url]
    shown = subprocess.run([*tidepool, "--json"], cwd=fleet.root, env=b.env, capture_output=True, text=True,
                           timeout=30, check=True)
    listed = json.loads(shown.stdout)["nodes"]
    types = ["append", "http_probe", "insist", "noop", "scan", "sleep", "tcp_connect"]  # with discover's steps
    assert [(n["node_id"], n["alive"], n["task_types"], n["max_workers"]) for n in listed] == [
        (name, True, types, 4) for name in ("a", "b", "c")]
    assert {n["pid"] for n in listed} == {a.pid, b.pid, c.pid}
    table = subprocess.run(tidepool, cwd=fleet.root, env={**b.env, "COLUMNS": "200"}, capture_output=True,
                           text=True, timeout=30, check=True).stdout
    assert all(f" {name} " in table for name in ("a", "b", "c")) and table.count(" yes ") == 3, table


def test_waiting_through_a_node_that_does_not_run_the_task_ends_soon_after_the_task(fleet: Fleet) -> None:
    """A daemon streams its own node's events: a follower of a task run elsewhere hears nothing after
    `task.created` and must find the end by reading the task again after a silence."""
    a, b = fleet.add("a", pool={"task_types": ["noop"]}), fleet.add("b")
    fleet.start(a, b)

    async def follow() -> tuple[dict[str, Any], float]:
        async with Client(a.url) as client:
            task = await client.submit("append", {"file": str(fleet.done_file), "seconds": 0.2})
            started = time.monotonic()
            return await client.wait(task["id"], poll_s=1.0), time.monotonic() - started

    final, waited_s = asyncio.run(follow())
    assert final["state"] == "completed" and final["node_id"] == "b"
    # a silence of 2.5 * poll_s, then a read; it used to be the stream's whole 10 * poll_s
    assert waited_s < 8.0, waited_s


def test_a_nul_character_is_bad_input_not_an_unavailable_store(fleet: Fleet) -> None:
    """PostgreSQL cannot hold or compare text with a NUL in it: before the API refused it, its error came
    back as a 503 store_unavailable, which clients retry for ever."""
    a = fleet.add("a")
    fleet.start(a)
    for method, path, _ in NUL_REQUESTS:
        assert a.request(method, path).status == 400, path
    assert a.post("/v1/tasks", {"type": "noop", "idempotency_key": "a\x00b"}).status == 400


def test_sigkill_of_a_node_mid_run_its_tasks_finish_on_the_others_after_lease_expiry(fleet: Fleet) -> None:
    a, b, c = (fleet.add(n) for n in ("a", "b", "c"))
    fleet.start(a, b, c)
    ids = fleet.submit("insist", 48, via=[a, b, c], seconds=1.0)
    fleet.wait("node c running 4 tasks", lambda: len(fleet.live_attempts("c")) == 4)
    c.kill()
    killed = fleet.live_attempts("c")
    assert killed, "node c held no lease when it was killed"

    fleet.wait("every task completed", lambda: fleet.completed(ids), timeout_s=40)
    for task_id, attempt_id in killed:
        rows = fleet.q("SELECT id, node_id, status FROM attempts WHERE task_id = $1 ORDER BY number", task_id)
        statuses = {r[0]: r[2] for r in rows}
        assert statuses[attempt_id] == "expired", rows
        assert rows[-1][2] == "succeeded" and rows[-1][1] in ("a", "b"), rows
    assert set(fleet.lines(fleet.done_file)) == set(ids)
    (succeeded_twice,), = fleet.q(
        "SELECT count(*) FROM (SELECT task_id FROM attempts WHERE status = 'succeeded' GROUP BY task_id "
        "HAVING count(*) > 1) AS twice")
    assert succeeded_twice == 0
    fleet.assert_no_overlapping_attempts()
    # The registry: c stops saving heartbeats and turns not-alive within three of them (2 s each).
    fleet.wait("node c not alive", lambda: fleet.nodes(a) == {"a": True, "b": True, "c": False}, timeout_s=10)
    assert fleet.nodes(b) == {"a": True, "b": True, "c": False}


def test_sigstop_past_the_lease_then_sigcont_its_late_write_is_rejected_and_the_retry_stands(fleet: Fleet) -> None:
    a = fleet.add("a")
    fleet.start(a)
    (task_id,) = fleet.submit("insist", 1, via=[a], seconds=2.0)
    fleet.wait("the task running on a", lambda: fleet.live_attempts("a"))
    (_, stale), = fleet.live_attempts("a")
    b = fleet.add("b")
    fleet.start(b)
    a.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        fleet.wait("b to finish the task", lambda: fleet.completed([task_id]), timeout_s=20)
    finally:
        a.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    fleet.wait("a's late result write", lambda: fleet.lines(fleet.rejected_file), timeout_s=10)
    assert fleet.lines(fleet.rejected_file) == [task_id, stale], "the late write was not rejected by LeaseLost"

    task = b.task(task_id)
    assert task["state"] == "completed"
    assert [(x["node_id"], x["status"]) for x in task["attempts"]] == [("a", "expired"), ("b", "succeeded")]
    winner = task["attempts"][1]["id"]
    assert [r["payload"] for r in task["results"]] == [{"attempt": winner}], "the retried attempt's result stands"
    # Woken, a gives the lease up (then its attempt writes no outcome) or, if the plugin's refused write comes
    # first, posts a finish the store rejects: either way nothing of the stale attempt stands.
    fleet.wait("a's stale attempt abandoned or its finish rejected",
               lambda: "outcome not recorded" in (log := a.log(200)) or "rejected" in log)
    assert a.get("/readyz").status == 200
    fleet.assert_no_overlapping_attempts()


class Proxy:
    """A TCP proxy to the PostgreSQL server on a thread of its own: cut() drops every connection and refuses
    new ones until restore(); blackhole() keeps every connection, accepts new ones, and forwards nothing (a
    firewall dropping packets). The shared server itself is never touched."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pg-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._serving: set[asyncio.Task[None]] = set()
        self.blackholed = False

    def __enter__(self) -> Proxy:
        self._thread.start()
        self.restore()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def cut(self) -> None:
        self._call(self._cut())

    def restore(self) -> None:
        self._call(self._listen())

    def blackhole(self) -> None:
        self.blackholed = True

    def _call(self, coro: Any) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(5)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in self._open:
            writer.transport.abort()
        self._open.clear()
        if self._serving:  # each ends once its connections are gone
            await asyncio.wait(self._serving, timeout=2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        self._open.add(writer)
        try:
            if self.blackholed:  # a new connection's handshake goes nowhere either
                with contextlib.suppress(OSError):
                    while await reader.read(65536):
                        pass
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                return
            self._open.add(up_writer)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
            self._open.discard(up_writer)
        finally:
            writer.transport.abort()
            self._open.discard(writer)
            self._serving.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if not self.blackholed:
                    writer.write(data)
                    await writer.drain()
        finally:
            writer.transport.abort()


def test_database_outage_longer_than_the_lease_loses_nothing_and_rejects_stale_writes(fleet: Fleet) -> None:
    from urllib.parse import urlsplit

    server = urlsplit(POSTGRES_URL)
    with Proxy((server.hostname or "127.0.0.1", server.port or 5432)) as proxy:
        user = server.username or "postgres"
        cut_url = f"postgresql://{user}@127.0.0.1:{proxy.port}{server.path}?schema={fleet.schema}"
        a, b = fleet.add("a"), fleet.add("b")
        c = fleet.add("c", url=cut_url)
        fleet.start(a, b, c)
        ids = fleet.submit("insist", 36, via=[a, b, c], seconds=1.5)
        fleet.wait("node c running tasks", lambda: len(fleet.live_attempts("c", ("running",))) >= 2)

        proxy.cut()
        cut_at = time.monotonic()
        stranded = fleet.live_attempts("c")
        running = set(fleet.live_attempts("c", ("running",)))  # c's plugins surely run these
        ready = fleet.wait("c's /readyz 503", lambda: (r := c.get("/readyz")).status == 503 and r, timeout_s=5)
        assert "store unavailable" in ready.body["reason"]
        assert "tidepool_store_up 0.0" in c.get("/metrics").body
        # Cut for longer than the lease (3 s): the others expire c's leases and run its tasks meanwhile.
        fleet.wait("c's tasks taken over", lambda: all(
            fleet.q("SELECT status FROM attempts WHERE id = $1", attempt)[0][0] == "expired"
            for _, attempt in stranded), timeout_s=15)
        time.sleep(max(0.0, 6.0 - (time.monotonic() - cut_at)))
        assert c.get("/readyz").status == 503, "ready while its store was cut off"
        proxy.restore()

        fleet.wait("c ready again", lambda: c.get("/readyz").status == 200, timeout_s=15)
        fleet.wait("every task completed", lambda: fleet.completed(ids), timeout_s=40)

        def rejected() -> set[tuple[str, str]]:
            words = fleet.lines(fleet.rejected_file)
            return {(words[i], words[i + 1]) for i in range(0, len(words), 2)}

        fleet.wait("c's stale result writes rejected", lambda: running <= rejected())
        assert rejected() <= set(stranded), "a write was rejected that was not stale"

        for task_id in ids:
            task = a.task(task_id)
            winners = [x for x in task["attempts"] if x["status"] == "succeeded"]
            assert len(winners) == 1, task["attempts"]
            assert [r["payload"] for r in task["results"]] == [{"attempt": winners[0]["id"]}], task
        fleet.assert_no_overlapping_attempts()
        # c works again: its heartbeat is back and its API takes tasks.
        fleet.wait("c alive again", lambda: fleet.nodes(a).get("c") is True, timeout_s=10)
        more = fleet.submit("append", 30, via=[c])
        fleet.wait("the tasks submitted through c completed", lambda: fleet.completed(more))


def test_a_blip_shorter_than_the_lease_delays_finishes_without_rerunning_anything(fleet: Fleet) -> None:
    from urllib.parse import urlsplit

    server = urlsplit(POSTGRES_URL)
    with Proxy((server.hostname or "127.0.0.1", server.port or 5432)) as proxy:
        url = f"postgresql://{server.username or 'postgres'}@127.0.0.1:{proxy.port}{server.path}?schema={fleet.schema}"
        a = fleet.add("a", url=url, pool={"min_workers": 8, "max_workers": 8})
        fleet.start(a)
        ids = fleet.submit("append", 8, via=[a], seconds=1.0)
        fleet.wait("8 tasks running", lambda: len(fleet.live_attempts("a", ("running",))) == 8)
        proxy.cut()  # the plugins end during the cut: their finishes wait for the store
        time.sleep(1.5)  # under the 3 s lease: the node keeps its leases
        proxy.restore()
        fleet.wait("every task completed", lambda: fleet.completed(ids), timeout_s=15)
    rows = fleet.q("SELECT status, count(*) FROM attempts GROUP BY status")
    assert rows == [("succeeded", 8)], "a finish was lost and its task ran again"
    assert sorted(fleet.lines(fleet.done_file)) == sorted(ids)


def test_a_submit_to_a_blackholed_store_is_answered_503_naming_the_store_within_seconds(fleet: Fleet) -> None:
    """Packets to the database dropped (a firewall, a dead switch): nothing fails, nothing answers. The API
    must still say so in seconds, as it does when the server is down, not wait for minutes."""
    from urllib.parse import urlsplit

    server = urlsplit(POSTGRES_URL)
    with Proxy((server.hostname or "127.0.0.1", server.port or 5432)) as proxy:
        url = f"postgresql://{server.username or 'postgres'}@127.0.0.1:{proxy.port}{server.path}?schema={fleet.schema}"
        token_file = fleet.root / "api.token"  # the store is named to a caller with the token only
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        a = fleet.add("a", url=url, api={"token_file": str(token_file)})
        a.token = TOKEN
        fleet.start(a)
        assert a.post("/v1/tasks", {"type": "append", "payload": {"file": str(fleet.done_file)}}).status == 201
        proxy.blackhole()
        for _ in range(2):  # the pooled connections of before, then new ones, whose handshakes go unanswered
            started = time.monotonic()
            r = a.post("/v1/tasks", {"type": "append", "payload": {"file": str(fleet.done_file)}})
            waited_s = time.monotonic() - started
            assert r.status == 503 and r.body["error"]["code"] == "store_unavailable", r
            assert f"store 127.0.0.1:{proxy.port}{server.path} schema {fleet.schema}" in r.body["error"]["message"], r
            assert waited_s < 8.0, waited_s


def test_a_second_daemon_with_the_same_node_id_on_the_same_database_exits_2(fleet: Fleet) -> None:
    a = fleet.add("a")
    fleet.start(a)
    twin = fleet.add("twin", node={"id": "a"})
    result = twin.run_to_exit()
    assert result.returncode == 2, result.stderr
    assert f"pid {a.pid}" in result.stderr and "node a already runs" in result.stderr
    assert a.get("/readyz").status == 200, "the first daemon is unharmed"
    del fleet.daemons["twin"]
