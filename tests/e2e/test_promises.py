"""What the documentation promises of a running node, each shown against the real daemon: the `Tidepool-API`
header on every answer, the store's journal mode, /readyz while draining, the body deadline, the
connection cap, `submit --wait`'s exit codes, the ./config/tidepool.toml lookup and a read-only file."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from .conftest import TOKEN, UNKNOWN_ID, Daemon, cli_in_background, to_toml

pytestmark = pytest.mark.e2e
Cli = Callable[..., subprocess.CompletedProcess[str]]
OK, TASK_FAILED = 0, 1
API_HEADER = ("Tidepool-API", "v1")
BODY_DEADLINE_S = 30.0  # the documentation's: a request's body must arrive within 30 s
MAX_CONNECTIONS = 512


def answer(daemon: Daemon, method: str, path: str, body: bytes | None = None,
           headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage]:
    """(status, headers) of one request, its body left unread (an event stream never ends)."""
    connection = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers
    finally:
        connection.close()


def raw_answer(sock: socket.socket, *, timeout_s: float) -> bytes:
    """One answer read from `sock`: up to the end of its body, the connection's end, or `timeout_s`
    (b"" when nothing came)."""
    received = b""
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(ConnectionResetError):
        while not _complete(received) and (left := deadline - time.monotonic()) > 0 \
                and select.select([sock], [], [], left)[0]:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    return received


def closed_unanswered(sock: socket.socket, *, timeout_s: float) -> bool:
    """The daemon closed `sock` within `timeout_s` and sent nothing on it."""
    if not select.select([sock], [], [], timeout_s)[0]:
        return False  # still open: neither answered nor closed
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def _complete(received: bytes) -> bool:
    head, blank, body = received.partition(b"\r\n\r\n")
    lengths = [line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    return bool(blank) and bool(lengths) and len(body) >= int(lengths[0])


# the header by which a client knows it talks to tidepool

JSON = {"Content-Type": "application/json"}
EVERY_KIND_OF_ANSWER = [  # (method, path, body, headers, status)
    ("GET", "/healthz", None, {}, 200),
    ("GET", "/readyz", None, {}, 200),
    ("GET", "/metrics", None, {}, 200),
    ("GET", "/", None, {}, 200),  # the dashboard and its static files
    ("GET", "/static/app.js", None, {}, 200),
    ("GET", "/static/style.css", None, {}, 200),
    ("GET", "/static/nothing.js", None, {}, 404),
    ("GET", "/v1/openapi.json", None, {}, 200),
    ("GET", "/v1/events", None, {}, 200),
    ("GET", "/v1/pool", None, {}, 200),
    ("POST", "/v1/tasks", b'{"type": "noop"}', JSON, 201),
    ("GET", f"/v1/tasks/{UNKNOWN_ID}", None, {}, 404),
    ("GET", "/v1/no-such-route", None, {}, 404),
    ("DELETE", "/v1/pool", None, {}, 405),
    ("POST", "/v1/tasks", b'{"type": ', JSON, 400),
    ("POST", "/v1/tasks", b'{"type": "noop"}', {"Content-Type": "text/plain"}, 415),
    ("POST", "/v1/tasks", b'{"type": "noop", "payload": {"pad": "' + b"x" * 1100 * 1024 + b'"}}', JSON, 413),
    ("POST", "/v1/tasks", b'{"type": "noop"}', {**JSON, "Origin": "http://evil.example"}, 403),
    ("GET", "/v1/pool", None, {"Host": "rebound.example"}, 403),
    ("POST", f"/v1/tasks/{UNKNOWN_ID}/cancel", None, {}, 404),
]


def test_every_answer_carries_the_tidepool_api_header(daemon: Daemon) -> None:
    """Success or error, JSON, text or a static file: the header says a tidepool daemon answered."""
    wrong = []
    for method, path, body, headers, status in EVERY_KIND_OF_ANSWER:
        got, sent = answer(daemon, method, path, body, headers)
        if (got, sent.get(API_HEADER[0])) != (status, API_HEADER[1]):
            wrong.append(f"{method} {path[:60]}: {got} (expected {status}), {API_HEADER[0]}: {sent.get(API_HEADER[0])}")
    assert wrong == []


@pytest.mark.parametrize("request_head", [
    b"GET /v1/pool HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + b"t" * 9000 + b"\r\n\r\n",
    b"GET /v1/pool HTTP/1.1\r\nHost: 127.0.0.1\r\nNo colon here\r\n\r\n",
], ids=["header-over-8190-bytes", "malformed-header"])
def test_a_request_too_malformed_to_parse_is_answered_with_the_tidepool_api_header(daemon: Daemon,
                                                                                 request_head: bytes) -> None:
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(request_head)
        received = raw_answer(sock, timeout_s=5.0)
    head = received.partition(b"\r\n\r\n")[0].decode(errors="replace")
    assert head.split(" ", 2)[1] == "400", received[:300]
    assert f"{API_HEADER[0]}: {API_HEADER[1]}" in head.split("\r\n")[1:], head


def test_a_refused_token_is_answered_with_the_tidepool_api_header(token_daemon: Daemon) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}):
        status, sent = answer(token_daemon, "GET", "/v1/pool", headers=headers)
        assert (status, sent.get(API_HEADER[0])) == (401, API_HEADER[1])
    status, sent = answer(token_daemon, "GET", "/v1/pool", headers={"Authorization": f"Bearer {TOKEN}"})
    assert (status, sent.get(API_HEADER[0])) == (200, API_HEADER[1])


# the store's journal


def test_the_daemons_database_is_in_write_ahead_log_mode(daemon: Daemon) -> None:
    """WAL is a property of the file (synchronous=FULL is one of each connection: see
    tests/integration/test_sqlite_pragmas.py): an outside reader sees it in the header, too."""
    daemon.submit("noop")
    assert daemon.query("PRAGMA journal_mode") == [("wal",)]
    header = daemon.db_path.read_bytes()[:20]
    assert header[:16] == b"SQLite format 3\x00" and (header[18], header[19]) == (2, 2), header


# readiness


def test_readyz_answers_503_while_the_node_drains_and_healthz_still_200(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon({"pool": {"drain_timeout_s": 30.0}})
    daemon.start()
    task = daemon.submit("sleep", {"seconds": 30})
    daemon.wait_for("the task to run", lambda: daemon.task(task["id"])["state"] == "running")
    assert daemon.get("/readyz").status == 200
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)  # the drain waits for the running task: up to 30 s
    ready = daemon.wait_for("/readyz to answer 503", lambda: (r := daemon.get("/readyz")).status == 503 and r,
                            timeout_s=10)
    assert ready.body == {"status": "unavailable", "reason": "draining"}
    assert daemon.get("/healthz").status == 200, "the process still answers"
    assert daemon.proc.poll() is None
    daemon.proc.send_signal(signal.SIGINT)  # the second signal: interrupt the task, exit now
    assert daemon.proc.wait(20) == 0, daemon.log()


# the body deadline and the connection cap


def test_a_body_that_takes_longer_than_30s_is_answered_408_and_stores_nothing(daemon: Daemon) -> None:
    """The deadline is not configurable, so this takes its 30 s: the body trickles in, a byte every 2 s,
    never idle long enough for any other timeout to be the one that ends it."""
    head = (f"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(head + b'{"type": "noop", "payload": {"pad": "')
        sent_at = time.monotonic()
        received = b""
        while not received and time.monotonic() - sent_at < BODY_DEADLINE_S + 15:
            received = raw_answer(sock, timeout_s=2.0)
            if not received:
                sock.sendall(b"x")
        took = time.monotonic() - sent_at
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408 "), received[:300]
    assert BODY_DEADLINE_S - 1 <= took <= BODY_DEADLINE_S + 10, took
    assert f"{API_HEADER[0]}: {API_HEADER[1]}".encode() in rest.partition(b"\r\n\r\n")[0]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert daemon.get("/v1/tasks").body["tasks"] == [], "nothing of the slow request was stored"


def test_a_node_holds_at_most_512_connections_and_admits_again_when_one_closes(
        make_daemon: Callable[..., Daemon]) -> None:
    # The header deadline would cut the idle connections first: give them the whole test.
    daemon = make_daemon(env={"TIDEPOOL_API_HEADER_TIMEOUT_S": "300"})
    daemon.start()
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\n\r\n".encode()
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(socket.create_connection(("127.0.0.1", daemon.port), timeout=10))
                for _ in range(MAX_CONNECTIONS)]
        held[-1].sendall(request)  # answered: the daemon took every connection up to the 512th
        assert raw_answer(held[-1], timeout_s=5.0).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as one_more:
            one_more.sendall(request)
            assert closed_unanswered(one_more, timeout_s=5.0), "the 513th connection is closed unanswered"
        held.pop(0).close()
        daemon.wait_for("a connection to be admitted again", lambda: _healthz_on_a_new_connection(daemon, request))
        assert held[0].send(request) and raw_answer(held[0], timeout_s=5.0).startswith(b"HTTP/1.1 200 ")
    assert f"{MAX_CONNECTIONS} connections are open" in daemon.log(200)


def _healthz_on_a_new_connection(daemon: Daemon, request: bytes) -> bool:
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(request)
        return raw_answer(sock, timeout_s=2.0).startswith(b"HTTP/1.1 200 ")


# the command line


def test_submit_wait_exits_1_when_the_task_timed_out(make_daemon: Callable[..., Daemon], cli: Cli) -> None:
    daemon = make_daemon({"types.hurried": {"plugins": ["sleep"], "timeout_s": 0.5, "max_attempts": 1}})
    daemon.start()
    waited = cli("submit", "hurried", "--payload", '{"seconds": 30}', "--wait", "--url", daemon.url)
    assert waited.returncode == TASK_FAILED, waited.stderr
    task_id = waited.stdout.split()[0]
    assert daemon.task(task_id)["state"] == "timed_out"
    assert waited.stderr.strip().splitlines()[-1].startswith(f"{task_id} timed_out"), waited.stderr


def test_submit_wait_exits_1_when_the_task_is_cancelled(daemon: Daemon, tmp_path: Path) -> None:
    with cli_in_background("submit", "sleep", "--payload", '{"seconds": 30}', "--wait", "--url", daemon.url,
                           cwd=tmp_path) as waiting:
        running = daemon.wait_for("the task to run", lambda: daemon.get("/v1/tasks?state=running").body["tasks"])
        task_id = running[0]["id"]
        assert daemon.post(f"/v1/tasks/{task_id}/cancel").status == 202
        stdout, stderr = waiting.communicate(timeout=30)
    assert waiting.returncode == TASK_FAILED, stderr
    assert stdout.split() == [task_id] and daemon.task(task_id)["state"] == "cancelled"
    assert stderr.strip().splitlines()[-1].startswith(f"{task_id} cancelled"), stderr


def test_without_config_the_commands_read_config_tidepool_toml_of_the_working_directory(
        make_daemon: Callable[..., Daemon], cli: Cli, tmp_path: Path) -> None:
    """`cli` runs in tmp_path/cli: the daemon runs there too, and neither is told where its config is."""
    site = tmp_path / "cli"
    daemon = make_daemon({"node": {"id": "found-by-its-directory"}, "pool": {"max_workers": 7}}, root=site)
    (site / "config").mkdir()
    (site / "config" / "tidepool.toml").write_text(daemon.config_path.read_text())
    daemon.config_path.unlink()  # nothing else to be found
    daemon.args = []
    daemon.start()
    assert daemon.get("/v1/pool").body["node_id"] == "found-by-its-directory"
    pool = cli("pool", "--json")  # api.listen of ./config/tidepool.toml says where the daemon is
    assert pool.returncode == OK, pool.stderr
    assert (json.loads(pool.stdout)["node_id"], json.loads(pool.stdout)["max_workers"]) == ("found-by-its-directory", 7)
    checked = cli("config", "check")
    assert checked.returncode == OK and json.loads(checked.stdout)["pool"]["max_workers"] == 7, checked.stderr
    other = tmp_path / "other.toml"
    other.write_text(to_toml({"pool": {"max_workers": 9}}))
    explicit = cli("config", "check", "--config", str(other))
    assert json.loads(explicit.stdout)["pool"]["max_workers"] == 9, "--config comes first"


# a read-only database


@contextlib.contextmanager
def read_only(path: Path, unavailable: Callable[[str], NoReturn]) -> Iterator[None]:
    """`path` made read-only for this process: by its mode, or for root (whom modes do not stop) by the
    immutable attribute."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o444)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        unavailable(f"chattr +i {path} failed ({made.stderr.strip()}): root needs it to make a file read-only")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_read_only_database_answers_submits_503_naming_it_and_still_reads(
        make_token_daemon: Callable[..., Daemon], unavailable: Callable[[str], NoReturn]) -> None:
    daemon = make_token_daemon()
    daemon.token = TOKEN  # the store's failure is told word for word to a caller with the token only
    kept = daemon.wait_terminal(daemon.submit("noop")["id"])
    assert daemon.stop() == 0
    with read_only(daemon.db_path, unavailable):
        daemon.start(until="/healthz")  # it starts, though it cannot be ready
        try:
            refused = daemon.post("/v1/tasks", {"type": "noop"})
            assert (refused.status, refused.error["code"]) == (503, "store_unavailable"), refused
            assert "readonly" in refused.error["message"] and str(daemon.db_path) in refused.error["message"]
            ready = daemon.get("/readyz")
            assert ready.status == 503 and "readonly" in ready.body["reason"], ready
            assert "tidepool_store_up 0.0" in daemon.request("GET", "/metrics").body
            assert daemon.task(kept["id"])["state"] == "completed", "what the file holds is still read"
        finally:
            daemon.stop()
    assert daemon.query("SELECT count(*) FROM tasks") == [(1,)], "nothing was written to it"
