"""The API's safety on a live daemon: bearer auth, refusals that name the field and change nothing,
idempotent and delayed submits, retry answers, the queue limit, and the slowloris cut-off."""

from __future__ import annotations

import json
import selectors
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from .api_helpers import NUL_REQUESTS, bearer, call, store_counts
from .conftest import TOKEN, UNKNOWN_ID, Daemon, Response, free_port, to_toml


def later(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


# every documented /v1 route: (method, path, body)
ROUTES: list[tuple[str, str, object]] = [
    ("POST", "/v1/tasks", {"type": "noop"}),
    ("POST", "/v1/tasks/batch", {"tasks": [{"type": "noop"}]}),
    ("GET", f"/v1/tasks/{UNKNOWN_ID}", None),
    ("GET", "/v1/tasks?state=pending&limit=5", None),
    ("POST", f"/v1/tasks/{UNKNOWN_ID}/cancel", None),
    ("POST", f"/v1/tasks/{UNKNOWN_ID}/retry", None),
    ("GET", "/v1/pool", None),
    ("PATCH", "/v1/pool", {"max_workers": 20}),
    ("GET", "/v1/events", None),
    ("GET", "/v1/nodes", None),
    ("GET", "/v1/schedules", None),
    ("POST", "/v1/schedules", {"name": "n", "type": "noop", "every_s": 3600}),
    ("DELETE", "/v1/schedules/n", None),
    ("POST", "/v1/schedules/n/pause", None),
    ("POST", "/v1/schedules/n/resume", None),
    ("GET", "/v1/openapi.json", None),
]


@pytest.mark.e2e
def test_with_a_token_file_every_v1_route_answers_401_alike_without_the_token(token_daemon: Daemon) -> None:
    same_length = "x" * len(TOKEN)
    wrong = [{}, bearer("nope"), bearer(same_length), bearer(TOKEN[:-1]), bearer(TOKEN + "x"),
             {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}, bearer("")]
    answers: set[tuple[int, str]] = set()
    for method, path, body in ROUTES:
        for headers in wrong:
            r = call(token_daemon, method, path, body, headers=headers, timeout_s=5)
            assert r.status == 401, (method, path, headers, r)
            answers.add((r.status, json.dumps(r.body, sort_keys=True)))
    # bytes no client library would send: a header that is not UTF-8, and paths that only normalise to /v1
    for auth, path in ((b"Bearer \xff\xfe", "/v1/pool"), (b"Bearer nope", "/V1/pool"),
                       (b"Bearer nope", "/v1//pool"), (b"Bearer nope", "/%761/pool")):
        with socket.create_connection(("127.0.0.1", token_daemon.port), timeout=5) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n".encode() +
                      b"Authorization: " + auth + b"\r\n\r\n")
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401"), (auth, path, raw[:300])
        answers.add((401, json.dumps(json.loads(body), sort_keys=True)))
    assert len(answers) == 1, f"every refusal must look the same, got {answers}"
    assert json.loads(answers.pop()[1])["error"]["code"] == "unauthorized"
    sneaky = call(token_daemon, "GET", "/static/%2E%2E/v1/pool", headers=bearer("nope"))
    assert sneaky.status == 404, f"the static files must not lead to the API: {sneaky}"

    for path in ("/healthz", "/readyz"):
        assert call(token_daemon, "GET", path).status == 200, f"{path} stays open for probes"
    assert token_daemon.query("SELECT count(*) FROM tasks") == [(0,)], "a refused submit stored nothing"
    assert token_daemon.query("SELECT count(*) FROM schedules") == [(0,)]


@pytest.mark.e2e
def test_with_the_token_every_v1_route_works(token_daemon: Daemon) -> None:
    auth = bearer(TOKEN)

    def ok(method: str, path: str, body: object = None, status: int = 200) -> Response:
        r = call(token_daemon, method, path, body, headers=auth)
        assert r.status == status, (method, path, r)
        return r

    task = ok("POST", "/v1/tasks", {"type": "noop", "available_at": later(3600)}, 201).body
    (batched,) = ok("POST", "/v1/tasks/batch", {"tasks": [{"type": "noop"}]}, 201).body["ids"]
    assert ok("GET", f"/v1/tasks/{task['id']}").body["state"] == "pending"
    listed = ok("GET", "/v1/tasks?limit=10").body["tasks"]
    assert {t["id"] for t in listed} == {task["id"], batched}
    assert ok("POST", f"/v1/tasks/{task['id']}/cancel", status=202).body == {"state": "cancelled"}
    assert ok("POST", f"/v1/tasks/{task['id']}/retry", status=202).body["state"] == "pending"
    assert ok("GET", "/v1/pool").body["node_id"] == "e2e-node"
    assert ok("PATCH", "/v1/pool", {"max_workers": 20}).body["max_workers"] == 20
    assert ok("GET", "/v1/openapi.json").body["openapi"].startswith("3.1")
    assert "e2e-node" in json.dumps(ok("GET", "/v1/nodes").body["nodes"])
    ok("POST", "/v1/schedules", {"name": "hourly", "type": "noop", "every_s": 3600}, 201)
    assert [s["name"] for s in ok("GET", "/v1/schedules").body["schedules"]] == ["hourly"]
    ok("POST", "/v1/schedules/hourly/pause")
    ok("POST", "/v1/schedules/hourly/resume")
    ok("DELETE", "/v1/schedules/hourly", status=204)

    with socket.create_connection(("127.0.0.1", token_daemon.port), timeout=5) as s:
        s.sendall(f"GET /v1/events HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        head = b""
        while b": connected" not in head:
            head += s.recv(4096)
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head


@pytest.mark.e2e
def test_off_loopback_without_a_token_file_refuses_to_start_with_exit_2(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon({"api": {"listen": f"0.0.0.0:{free_port()}"}})
    result = daemon.run_to_exit()
    assert result.returncode == 2, result.stderr
    assert "api.token_file" in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.e2e
def test_bad_requests_are_refused_naming_the_field_and_change_nothing(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon({"api": {"max_body_kb": 1}})
    daemon.start()
    pool_before = call(daemon, "GET", "/v1/pool").body
    empty = store_counts(daemon)
    assert empty == (0, dict.fromkeys(("pending", "leased", "running", "retry_wait", "cancelling"), 0))

    def refused(status: int, code: str | None, names: str, method: str = "POST", path: str = "/v1/tasks",
                body: object = None, **kw: object) -> None:
        r = call(daemon, method, path, body, **kw)  # type: ignore[arg-type]
        assert r.status == status, (path, body, r)
        assert set(r.body) == {"error"} and set(r.error) == {"code", "message"}, r
        if code is not None:
            assert r.error["code"] == code, r
        assert names in r.error["message"], f"the error must name {names!r}: {r.error}"
        assert store_counts(daemon) == empty, f"{path} {body} changed the store"

    refused(400, "invalid_json", "JSON", data=b'{"type": "noop",')
    refused(400, "invalid_json", "JSON", data=b'{"type": "noop", "priority": NaN}')
    # JSON, but infinity as a float: stored, it made every answer listing the task invalid JSON
    refused(400, "invalid_json", "1e400", data=b'{"type": "noop", "payload": {"x": 1e400}}')
    refused(400, "invalid_json", "-1e999", data=b'{"type": "noop", "payload": {"x": [-1e999]}}')
    refused(400, "invalid_request", "priority", body={"type": "noop", "priority": "high"})
    refused(400, "invalid_request", "priority", body={"type": "noop", "priority": "5"})  # no silent coercion
    refused(400, "invalid_request", "priority", body={"type": "noop", "priority": True})
    refused(400, "invalid_request", "max_attempts", body={"type": "noop", "max_attempts": 0})
    refused(400, "invalid_request", "available_at", body={"type": "noop", "available_at": "tomorrow"})
    refused(400, "invalid_request", "colour", body={"type": "noop", "colour": "red"})
    refused(400, "invalid_request", "type", body={"type": "no-such-type"})
    refused(400, "invalid_request", "type", body={"payload": {}})
    refused(400, "invalid_request", "required_tags", body={"type": "noop", "required_tags": ["gpu"]})
    refused(400, "invalid_request", "required_tags.0", body={"type": "noop", "required_tags": [" gpu"]})
    refused(400, "invalid_request", "required_tags.0", body={"type": "noop", "required_tags": [""]})
    refused(400, "invalid_request", "body", body=[{"type": "noop"}])
    refused(413, "body_too_large", "1 KiB", body={"type": "noop", "payload": {"blob": "x" * 4096}})
    refused(415, None, "application/json", data=b'{"type": "noop"}', content_type="text/plain")
    refused(415, None, "application/json", data=b'{"type": "noop"}', content_type=None)
    refused(400, "invalid_request", "limit", "GET", "/v1/tasks?limit=100000")
    refused(400, "invalid_request", "limit", "GET", "/v1/tasks?limit=0")
    refused(400, "invalid_request", "limit", "GET", "/v1/tasks?limit=ten")
    refused(400, "invalid_request", "state", "GET", "/v1/tasks?state=sleeping")
    refused(400, "invalid_request", "tasks.1.priority", path="/v1/tasks/batch",
            body={"tasks": [{"type": "noop"}, {"type": "noop", "priority": "high"}]})
    refused(400, "invalid_request", "tasks.2.type", path="/v1/tasks/batch",
            body={"tasks": [{"type": "noop"}, {"type": "sleep"}, {"type": "no-such-type"}]})
    refused(400, "invalid_request", "tasks", path="/v1/tasks/batch", body={"tasks": []})
    refused(404, "not_found", "batch", "GET", "/v1/tasks/batch")  # no task has that id: 404, as any other
    refused(405, "method_not_allowed", "", "PUT", "/v1/tasks/batch")
    refused(400, "invalid_request", "state", "GET", "/v1/tasks?state=pending&state=failed")
    refused(400, "invalid_request", "stat", "GET", "/v1/tasks?stat=failed")  # misspelt: not everything
    refused(400, "invalid_request", "limit", "GET", "/v1/tasks?limit=1_0")
    refused(400, "invalid_request", "type", "GET", "/v1/tasks?type=")
    refused(400, "invalid_request", "min_workers", "PATCH", "/v1/pool", body={"min_workers": "many"})
    for method, path, names in NUL_REQUESTS:  # a 400, not whatever the store makes of a NUL
        refused(400, "invalid_request", names, method, path)
    refused(400, "invalid_request", "idempotency_key", body={"type": "noop", "idempotency_key": "a\x00b"})
    refused(400, "invalid_request", "min_workers", "PATCH", "/v1/pool", body={"min_workers": 0})  # nothing would claim
    refused(400, "invalid_request", "max_workers", "PATCH", "/v1/pool", body={"min_workers": 8, "max_workers": 4})
    assert daemon.query("SELECT count(*) FROM tasks") == [(0,)]
    pool_after = call(daemon, "GET", "/v1/pool").body
    assert {k: pool_after[k] for k in ("min_workers", "max_workers", "idle_timeout_s")} == \
        {k: pool_before[k] for k in ("min_workers", "max_workers", "idle_timeout_s")}


@pytest.mark.e2e
def test_max_queued_refuses_the_next_submit_and_a_whole_batch_over_it(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon({"pool": {"max_queued": 3}})
    daemon.start()
    held = {"type": "noop", "available_at": later(3600)}  # pending for the whole test
    ids = [call(daemon, "POST", "/v1/tasks", held).body["id"] for _ in range(3)]
    assert store_counts(daemon)[1]["pending"] == 3

    fourth = call(daemon, "POST", "/v1/tasks", held)
    assert fourth.status == 429 and fourth.error["code"] == "queue_full", fourth
    listed, queue = store_counts(daemon)
    assert (listed, queue["pending"]) == (3, 3)

    for task_id in ids[:2]:
        assert call(daemon, "POST", f"/v1/tasks/{task_id}/cancel").status == 202
    over = call(daemon, "POST", "/v1/tasks/batch", {"tasks": [held] * 3})  # 1 queued + 3 > 3
    assert over.status == 429 and over.error["code"] == "queue_full", over
    assert "these 3 would make 4" in over.error["message"], over
    assert store_counts(daemon)[1]["pending"] == 1, "a batch over the limit is refused whole"
    fits = call(daemon, "POST", "/v1/tasks/batch", {"tasks": [held] * 2})
    assert fits.status == 201 and len(fits.body["ids"]) == 2
    listed, queue = store_counts(daemon)
    assert (listed, queue["pending"]) == (5, 3)


@pytest.mark.e2e
def test_the_same_idempotency_key_returns_the_task_and_a_different_body_conflicts(daemon: Daemon) -> None:
    body = {"type": "noop", "payload": {"target": "a"}, "idempotency_key": "order-17"}
    first = call(daemon, "POST", "/v1/tasks", body)
    again = call(daemon, "POST", "/v1/tasks", body)
    assert (first.status, again.status) == (201, 200)
    assert again.body["id"] == first.body["id"] and again.body["idempotency_key"] == "order-17"

    other = call(daemon, "POST", "/v1/tasks", {**body, "payload": {"target": "b"}})
    assert other.status == 409 and other.error["code"] == "conflict", other
    assert store_counts(daemon)[0] == 1

    in_batch = call(daemon, "POST", "/v1/tasks/batch", {"tasks": [{**body, "priority": 5}]})
    assert in_batch.status == 409, in_batch
    assert store_counts(daemon)[0] == 1

    # a batch sent again (its answer was lost) finds its keyed tasks: 200 with the same ids, none twice
    batch = {"tasks": [body, {"type": "noop", "idempotency_key": "order-18"}]}
    resent = call(daemon, "POST", "/v1/tasks/batch", batch)
    assert resent.status == 201 and resent.body["ids"][0] == first.body["id"], resent
    assert call(daemon, "POST", "/v1/tasks/batch", batch).body == resent.body
    assert call(daemon, "POST", "/v1/tasks/batch", batch).status == 200
    assert store_counts(daemon)[0] == 2


@pytest.mark.e2e
def test_a_task_with_available_at_in_the_future_waits_until_then(daemon: Daemon) -> None:
    at = datetime.now(UTC) + timedelta(seconds=1.5)
    task = call(daemon, "POST", "/v1/tasks", {"type": "noop", "available_at": at.isoformat()}).body
    assert abs(datetime.fromisoformat(task["available_at"]) - at) < timedelta(milliseconds=1)

    observed = []
    while (state := daemon.task(task["id"])["state"]) not in ("completed", "failed"):
        observed.append((datetime.now(UTC), state))
        time.sleep(0.1)
    early = [s for when, s in observed if when < at - timedelta(seconds=0.05)]
    assert early and set(early) == {"pending"}, observed
    ended = daemon.task(task["id"])
    assert ended["state"] == "completed"
    started = datetime.fromisoformat(ended["attempts"][0]["started_at"])
    assert started >= datetime.fromisoformat(ended["available_at"]), "it was claimed before its time"


@pytest.mark.e2e
def test_retry_runs_a_failed_task_again_and_refuses_a_pending_one(daemon: Daemon) -> None:
    failing = daemon.submit("sleep", {"seconds": "soon"})  # invalid_argument: failed, not retried by itself
    ended = daemon.wait_terminal(failing["id"])
    assert ended["state"] == "failed" and len(ended["attempts"]) == 1

    r = call(daemon, "POST", f"/v1/tasks/{failing['id']}/retry")
    assert r.status == 202 and r.body["state"] == "pending", r
    again = daemon.wait_for("the retried task to run again",
                            lambda: len((t := daemon.task(failing["id"]))["attempts"]) == 2 and
                            t["state"] == "failed" and t)
    assert [a["status"] for a in again["attempts"]] == ["failed", "failed"]

    waiting = daemon.submit("noop", available_at=later(3600))
    r = call(daemon, "POST", f"/v1/tasks/{waiting['id']}/retry")
    assert r.status == 409 and r.error["code"] == "conflict", r
    assert daemon.task(waiting["id"])["state"] == "pending"
    assert call(daemon, "POST", f"/v1/tasks/{UNKNOWN_ID}/retry").status == 404


@pytest.mark.e2e
def test_cancel_and_retry_refuse_a_body_asking_for_more_and_change_nothing(daemon: Daemon) -> None:
    waiting = daemon.submit("noop", available_at=later(3600))
    for body, data, names in (({"reason": "obsolete"}, None, "reason"), (None, b"garbage{", "JSON")):
        r = call(daemon, "POST", f"/v1/tasks/{waiting['id']}/cancel", body, data=data)
        assert r.status == 400 and names in r.error["message"], r
    assert daemon.task(waiting["id"])["state"] == "pending"
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as s:  # an empty body, chunked
        s.sendall(f"POST /v1/tasks/{waiting['id']}/cancel HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                  "application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".encode())
        time.sleep(0.2)  # the end of the body comes after the headers were read
        s.sendall(b"0\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 202"), "no body is no body, however it is sent"
    again = daemon.submit("noop", available_at=later(3600))
    assert call(daemon, "POST", f"/v1/tasks/{again['id']}/cancel", {}).status == 202  # {} asks for nothing

    failing = daemon.submit("sleep", {"seconds": "soon"}, max_attempts=1)
    assert daemon.wait_terminal(failing["id"])["state"] == "failed"
    r = call(daemon, "POST", f"/v1/tasks/{failing['id']}/retry", {"max_attempts": 5})  # it would not apply
    assert r.status == 400 and "max_attempts" in r.error["message"], r
    assert daemon.task(failing["id"])["state"] == "failed"


@pytest.mark.e2e
def test_a_task_of_a_type_the_node_no_longer_defines_is_not_retried(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon({"types.nightly": {"plugins": ["sleep"]}})
    daemon.start()
    failing = daemon.submit("nightly", {"seconds": "soon"}, max_attempts=1)  # invalid_argument: failed
    done = daemon.submit("nightly", {"seconds": 0})
    assert [daemon.wait_terminal(t["id"])["state"] for t in (failing, done)] == ["failed", "completed"]
    assert daemon.stop() == 0
    del daemon.config["types.nightly"]
    daemon.config_path.write_text(to_toml(daemon.config))
    daemon.start()
    r = call(daemon, "POST", f"/v1/tasks/{failing['id']}/retry")
    assert r.status == 400 and "type" in r.error["message"] and "'nightly'" in r.error["message"], r
    assert daemon.task(failing["id"])["state"] == "failed", "a bad request changes nothing"
    assert call(daemon, "POST", f"/v1/tasks/{done['id']}/retry").status == 409, "its state is what refuses it"
    assert call(daemon, "POST", f"/v1/tasks/{UNKNOWN_ID}/retry").status == 404


HEADER_TIMEOUT_S = 1.5


@pytest.fixture
def short_deadline(make_daemon: Callable[..., Daemon]) -> Daemon:
    """A daemon whose header deadline is HEADER_TIMEOUT_S, so that cut-offs show within seconds."""
    daemon = make_daemon(env={"TIDEPOOL_API_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)})
    daemon.start()
    return daemon


@pytest.mark.e2e
def test_a_client_trickling_its_headers_is_cut_off_while_others_are_served(short_deadline: Daemon) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slowloris\r\n\r\n"
    outcome: dict[str, float | int | str] = {}

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", short_deadline.port), timeout=30) as s:
            started = time.monotonic()
            try:
                for i, byte in enumerate(request):
                    s.sendall(bytes([byte]))
                    outcome["sent"] = i + 1
                    time.sleep(1.0)
                    s.setblocking(False)  # a closed connection shows as EOF or a reset
                    try:
                        if s.recv(1) == b"":
                            break
                    except BlockingIOError:
                        pass
                    finally:
                        s.setblocking(True)
                outcome["how"] = "closed"
            except OSError as exc:
                outcome["how"] = type(exc).__name__
            outcome["after_s"] = time.monotonic() - started

    slow = threading.Thread(target=trickle)
    slow.start()
    served = 0
    while slow.is_alive():
        r = call(short_deadline, "GET", "/v1/pool", timeout_s=2.0)  # others are served meanwhile, promptly
        assert r.status == 200
        served += 1
        time.sleep(0.1)
    slow.join()

    assert outcome["how"] in ("closed", "ConnectionResetError", "BrokenPipeError"), outcome
    assert int(outcome["sent"]) < len(request), f"the headers must never have completed: {outcome}"
    assert float(outcome["after_s"]) < 4 * HEADER_TIMEOUT_S + 2, outcome
    assert served >= 5, served


def _cut_off_within(s: socket.socket, seconds: float) -> bool:
    """True when the daemon closes or resets the connection within `seconds`, sending nothing."""
    s.settimeout(seconds)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.e2e
def test_the_header_deadline_applies_to_every_request_of_a_kept_alive_connection(short_deadline: Daemon) -> None:
    with socket.create_connection(("127.0.0.1", short_deadline.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = s.recv(4096)
        assert first.startswith(b"HTTP/1.1 200"), first
        time.sleep(2 * HEADER_TIMEOUT_S)  # idle between requests is keep-alive's business, not the deadline's
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: tid")  # the second request starts ... and stalls
        assert _cut_off_within(s, 3 * HEADER_TIMEOUT_S), "a stalled second request kept its connection"


@pytest.mark.e2e
def test_malformed_requests_get_400_and_at_most_one_log_line_each_without_a_traceback(daemon: Daemon) -> None:
    garbage = [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
               b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"]
    for raw in garbage:
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=5) as s:
            s.sendall(raw)
            assert s.recv(4096).startswith(b"HTTP/1.0 400"), raw
    assert call(daemon, "GET", "/healthz").status == 200
    log = daemon.log(200)
    assert "Traceback" not in log, log
    # aiohttp reports some of these (bad headers) and not others (a bad method): never more than one line each
    assert 1 <= log.count("malformed request refused with 400") <= len(garbage), log


@pytest.mark.e2e
def test_a_blank_line_in_an_unread_body_does_not_switch_the_next_header_deadline_off(short_deadline: Daemon) -> None:
    with socket.create_connection(("127.0.0.1", short_deadline.port), timeout=10) as s:
        s.sendall(b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\n")
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 405"), answer  # answered before its body was read
        s.sendall(b"ab\r\n\r\nxyzw")  # the rest of that body: it looks like the end of a header block
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: tid")  # the next request stalls
        assert _cut_off_within(s, 3 * HEADER_TIMEOUT_S + 2), "a stalled request after the body kept its connection"


@pytest.mark.e2e
def test_a_burst_of_clients_connecting_at_once_waits_in_the_listen_queue_not_in_syn_retries(daemon: Daemon) -> None:
    """The kernel completes handshakes while the daemon is busy (here: stopped) only for as many clients
    as the listen backlog holds; the rest wait a second for a SYN retry. 300 must all get in and be served
    (with asyncio's default backlog, 101 did)."""
    assert daemon.proc is not None
    # The kernel caps any backlog at net.core.somaxconn (4096 on current kernels, 128 before 5.4).
    burst = min(300, int(Path("/proc/sys/net/core/somaxconn").read_text()))
    clients = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(burst)]
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        with selectors.DefaultSelector() as selector:
            for s in clients:
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", daemon.port))
                selector.register(s, selectors.EVENT_WRITE)
            time.sleep(0.5)  # loopback handshakes take microseconds: what is not connected now was dropped
            ready = [key.fileobj for key, _ in selector.select(timeout=0)]
        connected = sum(1 for s in ready if isinstance(s, socket.socket)
                        and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    try:
        assert connected == len(clients)
        for s in clients:
            s.setblocking(True)
            s.settimeout(20)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        answers = [s.recv(64) for s in clients]
        assert all(a.startswith(b"HTTP/1.1 200") for a in answers), {a[:20] for a in answers}
    finally:
        for s in clients:
            s.close()


# every route that reads a JSON body, with DEEP where the nested arrays go
DEEP_BODIES = [("POST", "/v1/tasks", '{"type": "noop", "payload": {"a": DEEP}}'),
               ("POST", "/v1/tasks/batch", '{"tasks": [{"type": "noop", "payload": {"a": DEEP}}]}'),
               ("POST", "/v1/schedules", '{"name": "deep", "type": "noop", "every_s": 60, "payload": {"a": DEEP}}'),
               ("PATCH", "/v1/pool", '{"max_workers": DEEP}')]


@pytest.mark.e2e
def test_json_nested_too_deeply_is_400_on_every_route_that_reads_a_body(daemon: Daemon) -> None:
    pool_before = call(daemon, "GET", "/v1/pool").body
    for depth in (990, 5000, 300):  # beyond the interpreter's recursion limit, far beyond, beyond pydantic's
        for method, path, template in DEEP_BODIES:
            raw = template.replace("DEEP", "[" * depth + "]" * depth)
            r = call(daemon, method, path, data=raw.encode())
            assert r.status == 400 and r.error["code"] == "invalid_json", (depth, path, r)
            assert "body" in r.error["message"], r
    assert store_counts(daemon) == (0, dict.fromkeys(("pending", "leased", "running", "retry_wait", "cancelling"), 0))
    assert call(daemon, "GET", "/v1/schedules").body == {"schedules": []}
    pool_after = call(daemon, "GET", "/v1/pool").body
    assert pool_after["max_workers"] == pool_before["max_workers"]
    assert "Traceback" not in daemon.log(200), daemon.log(200)


@pytest.mark.e2e
def test_available_at_must_be_an_instant_the_task_json_can_show(daemon: Daemon) -> None:
    empty = store_counts(daemon)
    for at in ("9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00+01:00", "0001-01-01T00:00:00Z",
               "0999-12-31T23:59:59Z", "9999-12-31T23:59:59.999999Z"):
        r = call(daemon, "POST", "/v1/tasks", {"type": "noop", "available_at": at})
        assert r.status == 400 and r.error["code"] == "invalid_request", (at, r)
        assert r.error["message"].startswith("available_at:"), r
        r = call(daemon, "POST", "/v1/tasks/batch", {"tasks": [{"type": "noop"}, {"type": "noop", "available_at": at}]})
        assert r.status == 400 and r.error["message"].startswith("tasks.1.available_at:"), (at, r)
    assert store_counts(daemon) == empty

    for at, shown in (("9999-12-31T23:59:59Z", "9999-12-31T23:59:59.000000Z"),
                      ("9999-12-31T23:59:59+00:00", "9999-12-31T23:59:59.000000Z"),
                      ("2100-01-02T03:04:05", "2100-01-02T03:04:05.000000Z"),  # naive: UTC
                      ("2100-01-02T00:30:00+01:00", "2100-01-01T23:30:00.000000Z"),
                      ("1000-01-01T00:00:00Z", "1000-01-01T00:00:00.000000Z")):
        r = call(daemon, "POST", "/v1/tasks", {"type": "noop", "available_at": at})
        assert r.status == 201 and r.body["available_at"] == shown, (at, r)


@pytest.mark.e2e
def test_only_a_cursor_the_api_handed_out_is_accepted(daemon: Daemon) -> None:
    ids = [daemon.submit("noop", available_at=later(3600))["id"] for _ in range(3)]
    for cursor in ("zzz", "0", "%20", ids[1].upper(), ids[1] + "0", ids[1][:-1], ids[1][:-1] + "g"):
        r = call(daemon, "GET", f"/v1/tasks?cursor={cursor}")
        assert r.status == 400 and r.error["code"] == "invalid_request", (cursor, r)
        assert r.error["message"].startswith("cursor:"), r

    first = call(daemon, "GET", "/v1/tasks?limit=2").body
    assert [t["id"] for t in first["tasks"]] == ids[:0:-1] and first["next_cursor"]
    rest = call(daemon, "GET", f"/v1/tasks?limit=2&cursor={first['next_cursor']}").body
    assert ([t["id"] for t in rest["tasks"]], rest["next_cursor"]) == ([ids[0]], None)
    assert call(daemon, "GET", f"/v1/tasks?cursor={'0' * 32}").body == {"tasks": [], "next_cursor": None}


# what a web page the operator opens may not do (CSRF, DNS rebinding)


@pytest.mark.e2e
def test_a_page_of_another_origin_cannot_change_anything(daemon: Daemon) -> None:
    """Browsers send Origin with every cross-origin POST, also as `no-cors` with a text/plain body; such
    a request is refused before it reaches a route, whatever its content type."""
    task = daemon.submit("sleep", {"seconds": 30})
    assert daemon.post("/v1/schedules", {"name": "nightly", "type": "noop", "every_s": 3600}).status == 201
    foreign = [{"Origin": "http://evil.example"}, {"Origin": "http://localhost:45437"}, {"Origin": "null"}]
    for origin in foreign:
        for method, path in (("POST", f"/v1/tasks/{task['id']}/cancel"), ("POST", "/v1/schedules/nightly/pause"),
                             ("DELETE", "/v1/schedules/nightly")):
            r = call(daemon, method, path, data=b"x=y", content_type="text/plain", headers=origin)
            assert (r.status, r.body["error"]["code"]) == (403, "forbidden"), (origin, path, r)
        r = call(daemon, "POST", "/v1/tasks", {"type": "noop"}, headers=origin)
        assert r.status == 403, r
    assert daemon.get(f"/v1/tasks/{task['id']}").body["state"] in ("leased", "running")
    assert daemon.get("/v1/schedules").body["schedules"][0]["paused"] is False
    assert store_counts(daemon)[0] == 1  # the one task, nothing submitted from elsewhere
    own = {"Origin": daemon.url}  # the dashboard's own requests
    assert call(daemon, "POST", f"/v1/tasks/{task['id']}/cancel", headers=own).status == 202


@pytest.mark.e2e
def test_without_a_token_only_requests_to_a_loopback_name_are_answered(daemon: Daemon) -> None:
    """A DNS-rebinding page reaches the port under its own name: without a token that Host is refused."""
    port = daemon.url.rsplit(":", 1)[1]
    for host in (f"attacker.example:{port}", "attacker.example", f"192.168.1.7:{port}"):
        assert call(daemon, "GET", "/v1/pool", headers={"Host": host}).status == 403, host
        assert call(daemon, "GET", "/", headers={"Host": host}).status == 403, host
        r = call(daemon, "POST", "/v1/tasks", {"type": "noop"}, headers={"Host": host})
        assert (r.status, r.body["error"]["code"]) == (403, "forbidden")
    assert store_counts(daemon)[0] == 0
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
        assert call(daemon, "GET", "/v1/pool", headers={"Host": host}).status == 200, host


@pytest.mark.e2e
def test_with_a_token_a_proxy_may_pass_any_host_and_origin(token_daemon: Daemon) -> None:
    """A page cannot send the bearer header, so neither check is needed; a reverse proxy in front passes
    its own Host, and the browser the public Origin."""
    auth = bearer(TOKEN)
    proxied = {**auth, "Host": "127.0.0.1:8470", "Origin": "https://tidepool.example.com"}
    assert call(token_daemon, "GET", "/v1/pool", headers={**auth, "Host": "tidepool.example.com"}).status == 200
    assert call(token_daemon, "POST", "/v1/tasks", {"type": "noop"}, headers=proxied).status == 201
    r = call(token_daemon, "POST", "/v1/tasks", {"type": "noop"}, headers={"Origin": "http://evil.example"})
    assert r.status == 401
    assert store_counts(token_daemon, headers=auth)[0] == 1


@pytest.mark.e2e
def test_no_page_may_frame_the_dashboard(daemon: Daemon) -> None:
    req = urllib.request.Request(daemon.url + "/")
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10) as response:
        assert response.headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in response.headers["Content-Security-Policy"]
