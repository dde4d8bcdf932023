"""The `tidepool` command's exit codes against a live daemon, a dead address and bad configs: 0 done, 1 a
task that ended unsuccessfully, 2 refused, 3 no daemon answered or it cannot take the request now."""

from __future__ import annotations

import http.server
import json
import socket
import sqlite3
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tidepool.store import SCHEMA_VERSION

from .conftest import UNKNOWN_ID, Daemon, clean_env, cli_in_background, free_port, tidepool_command, to_toml

Cli = Callable[..., subprocess.CompletedProcess[str]]
OK, TASK_FAILED, USAGE, UNREACHABLE = 0, 1, 2, 3


@pytest.mark.e2e
def test_submit_wait_exits_0_when_completed_and_1_when_failed(daemon: Daemon, cli: Cli) -> None:
    ok = cli("submit", "sleep", "--payload", '{"seconds": 0.2}', "--wait", "--url", daemon.url)
    assert ok.returncode == OK, ok.stderr
    task_id = ok.stdout.split()[0]
    assert daemon.task(task_id)["state"] == "completed"

    bad = cli("submit", "sleep", "--payload", '{"seconds": "x"}', "--wait", "--url", daemon.url)
    assert bad.returncode == TASK_FAILED, bad.stderr
    task = daemon.task(bad.stdout.split()[0])
    assert task["state"] == "failed"
    assert task["error"]["code"] == "invalid_argument"
    assert len(task["attempts"]) == 1, "an invalid argument must not be retried"
    assert "payload.seconds" in bad.stderr


@pytest.mark.e2e
def test_submit_wait_exits_3_without_a_traceback_when_the_daemon_shuts_down(daemon: Daemon, tmp_path: Path) -> None:
    with cli_in_background("submit", "sleep", "--payload", '{"seconds": 30}', "--wait", "--url", daemon.url,
                           cwd=tmp_path) as waiting:
        daemon.wait_for("the task to run", lambda: daemon.get("/v1/tasks?state=running").body["tasks"])
        daemon.stop()  # SIGTERM: the task's event stream gets stream.closed, then the daemon is gone
        _, stderr = waiting.communicate(timeout=30)
    assert waiting.returncode == UNREACHABLE, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("tidepool: ") and f"127.0.0.1:{daemon.port}" in stderr


@pytest.mark.e2e
def test_show_prints_a_finished_task_as_a_person_reads_it(daemon: Daemon, cli: Cli) -> None:
    task_id = cli("submit", "sleep", "--payload", '{"seconds": 0.2}', "--wait", "--url", daemon.url).stdout.split()[0]
    shown = cli("show", task_id, "--url", daemon.url)
    assert shown.returncode == OK, shown.stderr
    facts = dict(line.split(None, 1) for line in shown.stdout.splitlines() if line[:1].isalpha() and " " in line)
    assert (facts["state"].strip(), facts["error"].strip(), facts["phase"].strip()) == ("completed", "-", "-")
    assert task_id.startswith(facts["short_id"].strip()) and len(facts["short_id"].strip()) < len(task_id)
    assert facts["progress"].strip() == "100% slept 0.20s of 0.2s"  # the last report, not an earlier flush
    assert facts["required_tags"].strip() == facts["idempotency_key"].strip() == "-"
    task = daemon.task(task_id)
    assert facts["available_at"].strip() == task["available_at"] and facts["finished_at"].strip() == task["finished_at"]
    assert "None" not in shown.stdout
    assert f"{daemon.task(task_id)['attempts'][0]['worker_id']} " in shown.stdout and "succeeded" in shown.stdout


@pytest.mark.e2e
def test_a_url_with_a_path_too_many_says_which_route_it_asked_for(daemon: Daemon, cli: Cli) -> None:
    result = cli("pool", "--url", f"{daemon.url}/v1")
    assert result.returncode == USAGE
    assert "no route GET /v1/v1/pool" in result.stderr, result.stderr


@pytest.mark.e2e
def test_list_says_when_there_are_more_tasks_and_the_cursor_pages_through_them(daemon: Daemon, cli: Cli) -> None:
    ids = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "noop"}] * 5}).body["ids"]
    seen: list[str] = []
    cursor: list[str] = []
    for _ in range(3):
        page = cli("list", "--limit", "2", *cursor, "--url", daemon.url)
        assert page.returncode == OK, page.stderr
        seen += [full for line in page.stdout.splitlines() if (words := line.split()) and len(words[0]) >= 12
                 for full in ids if full.startswith(words[0])]  # each id by a prefix that names it
        if "--cursor" not in page.stderr:
            break
        cursor = ["--cursor", page.stderr.split("--cursor ")[1].split()[0].strip("`")]
    assert seen == sorted(ids, reverse=True), "newest first, each once, across the pages"
    assert "more tasks" not in page.stderr, "the last page says nothing more"


@pytest.mark.e2e
def test_submit_and_list_take_an_organization(daemon: Daemon, cli: Cli) -> None:
    submitted = cli("submit", "noop", "--organization", "acme", "--url", daemon.url)
    assert submitted.returncode == OK, submitted.stderr
    acme = submitted.stdout.strip()
    assert daemon.task(acme)["organization"] == "acme"
    other = daemon.submit("noop")["id"]
    listed = cli("list", "--organization", "acme", "--json", "--url", daemon.url)
    assert listed.returncode == OK, listed.stderr
    assert [t["id"] for t in json.loads(listed.stdout)["tasks"]] == [acme] and other != acme
    refused = cli("submit", "noop", "--organization", "a b", "--url", daemon.url)
    assert refused.returncode == USAGE and "organization" in refused.stderr, refused


@pytest.mark.e2e
def test_list_and_schedules_print_whole_rows_with_times_to_the_second(daemon: Daemon, cli: Cli) -> None:
    """Piped (into grep, a file), as here: no column is cut, whatever width a terminal would have."""
    task_id = cli("submit", "noop", "--wait", "--url", daemon.url).stdout.split()[0]
    daemon.post("/v1/schedules", {"name": "hourly", "type": "noop", "every_s": 3600})
    wide = {"COLUMNS": "60"}
    row = next(line for line in cli("list", "--url", daemon.url, env=wide).stdout.splitlines() if task_id[:12] in line)
    created = daemon.task(task_id)["created_at"]  # RFC 3339 with microseconds in the JSON
    assert row.split() == [task_id[:12], "noop", "completed", "1/3", daemon.task(task_id)["node_id"],
                           created[:10], created[11:19]], row
    schedules = cli("schedules", "--url", daemon.url, env=wide).stdout
    (hourly,) = [line.split() for line in schedules.splitlines() if line.split()[:1] == ["hourly"]]
    assert hourly[:4] == ["hourly", "noop", "every", "3600s"] and len(hourly[5]) == 8, schedules
    assert "…" not in schedules


@pytest.mark.e2e
def test_a_reader_that_stops_early_gets_no_traceback(daemon: Daemon) -> None:
    """`tidepool list --json | head`: more than a pipe's buffer, and the reader goes away."""
    padded = {"type": "noop", "payload": {"pad": "x" * 500}}
    assert daemon.post("/v1/tasks/batch", {"tasks": [padded] * 200}).status == 201
    with subprocess.Popen([*tidepool_command(), "list", "--json", "--limit", "200", "--url", daemon.url],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env()) as lister:
        assert lister.stdout is not None and lister.stderr is not None
        assert lister.stdout.read(100)
        lister.stdout.close()
        assert lister.wait(timeout=30) == OK
        assert lister.stderr.read() == b""


@pytest.mark.e2e
def test_migrate_creates_the_store_of_its_config_and_takes_no_daemon_address(tmp_path: Path, cli: Cli) -> None:
    db = tmp_path / "fresh" / "tidepool.db"
    config = tmp_path / "migrate.toml"
    config.write_text(to_toml({"store": {"url": f"sqlite:///{db}"}}))
    migrated = cli("migrate", "--config", str(config))
    assert migrated.returncode == OK, migrated.stderr
    assert migrated.stdout.strip() == f"store sqlite:///{db}: created the schema (version {SCHEMA_VERSION})"
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    again = cli("migrate", "--config", str(config))
    assert again.stdout.strip() == \
        f"store sqlite:///{db}: the schema is current (version {SCHEMA_VERSION}); nothing to do"
    with sqlite3.connect(db) as conn:  # what a newer tidepool would leave: the store answers, retrying cannot help
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    for command in ("migrate", "run"):
        newer = cli(command, "--config", str(config))
        assert newer.returncode == 1 and "newer than this tidepool understands" in newer.stderr, newer.stderr
    for command in ("migrate", "run"):  # --url is the daemon's API: these read the config's store instead
        refused = cli(command, "--config", str(config), "--url", "postgresql://elsewhere/db")
        assert refused.returncode == USAGE and "unrecognized arguments: --url" in refused.stderr, refused.stderr


@pytest.mark.e2e
def test_show_of_an_unknown_task_is_a_usage_error(daemon: Daemon, cli: Cli) -> None:
    shown = cli("show", UNKNOWN_ID, "--url", daemon.url)
    assert shown.returncode == USAGE
    assert "not found" in shown.stderr
    assert shown.stdout == ""
    for odd in ("../pool", "x?y", "x#y", "../tasks"):  # one path segment, never another route or a query
        for command in ("show", "cancel", "retry"):
            result = cli(command, odd, "--url", daemon.url)
            assert (result.returncode, result.stdout) == (USAGE, ""), (command, odd, result.stderr)
            assert f"task {odd} not found" in result.stderr, (command, odd, result.stderr)


@pytest.mark.e2e
def test_every_client_command_exits_3_with_one_line_naming_the_address_when_no_daemon_runs(
        tmp_path: Path, cli: Cli) -> None:
    port = free_port()  # nothing listens here
    config = tmp_path / "dead.toml"
    config.write_text(to_toml({"api": {"listen": f"127.0.0.1:{port}"}}))
    for args in (["pool"], ["show", "x"], ["submit", "noop"]):
        result = cli(*args, "--config", str(config))
        assert result.returncode == UNREACHABLE, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], (args, result.stderr)
    by_url = cli("pool", "--url", f"http://127.0.0.1:{port}")
    assert by_url.returncode == UNREACHABLE and f"127.0.0.1:{port}" in by_url.stderr


@pytest.mark.e2e
def test_a_refused_token_is_exit_2_and_a_full_queue_exit_3_never_the_task_failed_code(
        make_daemon: Callable[..., Daemon], cli: Cli, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    daemon = make_daemon({"api": {"token_file": str(token)}, "pool": {"max_queued": 1}})
    daemon.start()
    daemon.token = "s3cret"
    daemon.submit("noop", available_at="2999-01-01T00:00:00Z")  # the queue is full from here on
    refused = cli("pool", "--url", daemon.url)  # no config here, so no token
    assert refused.returncode == USAGE and "401" in refused.stderr, refused.stderr
    config = tmp_path / "client.toml"
    config.write_text(to_toml({"api": {"listen": f"127.0.0.1:{daemon.port}", "token_file": str(token)}}))
    full = cli("submit", "noop", "--config", str(config))
    assert full.returncode == UNREACHABLE and "429" in full.stderr, full.stderr


@pytest.mark.e2e
def test_a_daemon_whose_store_is_down_is_unreachable_exit_3(make_daemon: Callable[..., Daemon], cli: Cli,
                                                              tmp_path: Path) -> None:
    """Exit 3 when the daemon or its store cannot be reached; the daemon says the latter with a 503 (why, to a
    caller with its token). Its database deleted under it, the daemon writes nothing more: a retry later
    (after a restart) may work."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    daemon = make_daemon({"api": {"token_file": str(token)}})
    daemon.start()
    config = tmp_path / "client.toml"
    config.write_text(to_toml({"api": {"listen": f"127.0.0.1:{daemon.port}", "token_file": str(token)}}))
    daemon.delete_database()
    for args in (["submit", "noop"], ["submit", "noop", "--wait"]):
        result = cli(*args, "--config", str(config))
        assert result.returncode == UNREACHABLE, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "(503 store_unavailable)" in lines[0] and "deleted" in lines[0], result.stderr


class NotTidepool(http.server.BaseHTTPRequestHandler):
    """What may answer at a daemon's address when no daemon does: a proxy whose daemon is down, or
    another service on the port."""

    answers = {"/proxy": (502, "text/html", b"<html><body><h1>502 Bad Gateway</h1></body></html>"),
               "/empty": (404, "text/plain", b""), "/other": (200, "text/html", b"<html>a directory</html>"),
               "/json": (200, "application/json", b'{"foo": 1}')}  # read as the daemon's: a KeyError traceback

    def do_GET(self) -> None:
        self.do_POST()

    def do_POST(self) -> None:
        status, content_type, body = self.answers[self.path.split("/v1")[0]]
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["proxy", "empty", "other", "json"])
def test_an_address_where_something_else_answers_is_unreachable_exit_3_in_one_line(cli: Cli, kind: str) -> None:
    """Exit 1 would say the task failed: a script must not take a proxy's error page for that."""
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotTidepool) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/{kind}"
        try:
            results = [cli(*args, "--url", url) for args in (["pool"], ["submit", "noop", "--wait"], ["list"])]
        finally:
            server.shutdown()
    for result in results:
        assert result.returncode == UNREACHABLE, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and url in lines[0] and "not as tidepool does" in lines[0], result.stderr


@pytest.mark.e2e
def test_a_token_file_that_is_not_text_is_a_config_error_naming_the_key(tmp_path: Path, cli: Cli) -> None:
    """It was a UnicodeDecodeError traceback and exit 1, which systemd's RestartPreventExitStatus=2 let restart."""
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe\x00bad")
    config = tmp_path / "client.toml"
    config.write_text(to_toml({"api": {"listen": f"127.0.0.1:{free_port()}", "token_file": str(token)}}))
    for args in (["pool"], ["run"]):
        result = cli(*args, "--config", str(config))
        assert result.returncode == USAGE, result.stderr
        assert "api.token_file" in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.e2e
def test_a_token_file_the_cli_cannot_read_is_a_config_error_naming_the_key(tmp_path: Path, cli: Cli) -> None:
    config = tmp_path / "client.toml"
    config.write_text(to_toml({"api": {"listen": f"127.0.0.1:{free_port()}", "token_file": str(tmp_path / "none")}}))
    result = cli("pool", "--config", str(config))
    assert result.returncode == USAGE, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "api.token_file" in lines[0] and str(tmp_path / "none") in lines[0], result.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("url", ["garbage", "ftp://127.0.0.1:8470", "http://127.0.0.1:99999", "http://"])
def test_a_url_that_is_no_address_is_a_usage_error_naming_url(cli: Cli, url: str) -> None:
    for args in (["pool"], ["show", "x"], ["submit", "noop"]):
        result = cli(*args, "--url", url)
        assert result.returncode == USAGE, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tidepool: --url: ") and repr(url) in lines[0], result.stderr


@pytest.mark.e2e
@pytest.mark.parametrize(("config", "env", "key"), [
    ({"pool": {"min_workers": 4, "max_workers": 2}}, {}, "pool.max_workers"),
    ({"pool": {"max_worker": 3}}, {}, "pool.max_worker"),
    ({}, {"TIDEPOOL_LEASE__DURATION_S": "soon"}, "lease.duration_s"),
    ({}, {"TIDEPOOL_POOL__TASK_TYPES": "sleep"}, "pool.task_types: TIDEPOOL_POOL__TASK_TYPES"),
    ({}, {"TIDEPOOL_PLUGINS__DENY": "noop"}, "plugins.deny: TIDEPOOL_PLUGINS__DENY"),
    ({"types.x": {"plugins": ["nothere"]}}, {}, "types.x.plugins: unknown plugin 'nothere'"),
    # a type the config writes (a built-in one the deny leaves out is left out: tests/unit/plugins/test_policy.py)
    ({"plugins.echo": {"command": ["/bin/echo", "{text}"]}, "types.echo": {"plugins": ["echo"]}},
     {"TIDEPOOL_PLUGINS__DENY": '["echo"]'}, "types.echo.plugins: plugin 'echo' is denied"),
    ({}, {"TIDEPOOL_API__LISTEN": "0.0.0.0:18541"}, "api.token_file is required"),
    ({}, {"TIDEPOOL_STORE__URL": "mysql://x"}, "store.url: unsupported URL"),
    ({}, {"TIDEPOOL_NODE__STATE_DIR": "/etc/hostname"}, "node.state_dir: /etc/hostname is not a directory"),
    ({"plugins.echo": {"command": ["/bin/echo", "{target.host}"]}, "types.echo": {"plugins": ["echo"]}}, {},
     "plugins.echo.command[1]: placeholder in '{target.host}' must be a plain {name}"),
], ids=["max-below-min", "unknown-key", "bad-env-override", "env-list-not-json", "env-deny-not-json",
        "unknown-plugin", "denied-plugin", "off-loopback-without-token", "unsupported-store", "state-dir-a-file",
        "command-template"])
def test_run_with_an_invalid_config_exits_2_naming_the_key(tmp_path: Path, cli: Cli, config: dict[str, dict[str, Any]],
                                                            env: dict[str, str], key: str) -> None:
    path = tmp_path / "bad.toml"
    port = free_port()
    path.write_text(to_toml({"api": {"listen": f"127.0.0.1:{port}"},
                             "store": {"url": f"sqlite:///{tmp_path / 'var' / 'bad.db'}"}, **config}))
    result = cli("run", "--config", str(path), env=env)
    assert result.returncode == USAGE, result.stderr
    assert key in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "var" / "bad.db").exists(), "an invalid config must not touch the store"
    check = cli("config", "check", "--config", str(path), env=env)
    assert check.returncode == USAGE and key in check.stderr, check.stderr
    assert len(check.stderr.strip().splitlines()) == 1 and check.stdout == "", "one line, no config printed"


@pytest.mark.e2e
def test_config_check_of_a_valid_file_exits_0_and_prints_the_effective_config(tmp_path: Path, cli: Cli) -> None:
    path = tmp_path / "good.toml"
    path.write_text(to_toml({"pool": {"min_workers": 3, "max_workers": 9}, "api": {"listen": "127.0.0.1:18999"}}))
    result = cli("config", "check", "--config", str(path), env={"TIDEPOOL_POOL__MAX_WORKERS": "12"})
    assert result.returncode == OK, result.stderr
    effective = json.loads(result.stdout)
    assert effective["pool"]["min_workers"] == 3
    assert effective["pool"]["max_workers"] == 12, "the environment beats the file"
    assert effective["api"]["listen"] == "127.0.0.1:18999"
    assert effective["node"]["id"] == socket.gethostname(), "no id configured: the host name, as the daemon uses"

    for url in ("postgresql://tp:s3cret@127.0.0.1/test", "postgresql://tp@127.0.0.1/test?password=s3cret"):
        result = cli("config", "check", "--config", str(path), env={"TIDEPOOL_STORE__URL": url})
        assert result.returncode == OK, result.stderr
        assert "s3cret" not in result.stdout and "***" in json.loads(result.stdout)["store"]["url"]


@pytest.mark.e2e
def test_a_listen_without_a_host_binds_loopback_needs_no_token_and_the_cli_finds_it(
        make_daemon: Callable[..., Daemon], cli: Cli) -> None:
    daemon = make_daemon()
    daemon.config["api"]["listen"] = f":{daemon.port}"
    daemon.config_path.write_text(to_toml(daemon.config))
    daemon.start()  # before: refused, "api.token_file is required when api.listen is not loopback"
    with socket.socket() as probe:  # bound on loopback only, as the port's owner says
        assert probe.connect_ex((_other_address(), daemon.port)) != 0
    result = cli("pool", "--json", "--config", str(daemon.config_path))
    assert result.returncode == OK, result.stderr
    assert json.loads(result.stdout)["min_workers"] >= 1


def _other_address() -> str:
    """An address of this host that is not loopback (the one its default route leaves from)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent
        return str(s.getsockname()[0])


# Task data on the terminal: what a plugin, a payload or a config puts in a task is shown as it is stored.
# Markup is not read as markup, and control characters arrive spelled out (ESC as \u001b) instead of
# clearing the screen, setting the window title or rewriting the line.

HOSTILE = "[bold red]MARKUP[/bold red] \x1b]0;PWNED-TITLE\x07 \x1b[2J\x1b[31mESC\r\x08\x7f\x9b :smile:"
SHOWN = "[bold red]MARKUP[/bold red] \\u001b]0;PWNED-TITLE\\u0007 \\u001b[2J\\u001b[31mESC\\u000d\\u0008\\u007f" \
        "\\u009b :smile:"
LOUD_TYPE, LOUD_TYPE_SHOWN = "loud[bold]TYPE[/bold]\x1b[2J", "loud[bold]TYPE[/bold]\\u001b[2J"
LOUD_NODE, LOUD_NODE_SHOWN = "node[bold]ID[/bold]\x1b]0;NODE\x07", "node[bold]ID[/bold]\\u001b]0;NODE\\u0007"
SHOUTING_PLUGIN = """
async def shout(ctx):
    ctx.progress(0.5, ctx.payload["msg"])
    await ctx.emit({"said": ctx.payload["msg"]})
    raise RuntimeError(ctx.payload["msg"])
"""
RAW = ("\x1b", "\x07", "\x08", "\r", "\x7f", "\x9b")  # what must never reach the terminal from data
WIDE = {"COLUMNS": "400"}  # every row on one line


def assert_no_raw_control(text: str) -> None:
    assert not [c for c in RAW if c in text], repr(text)


@pytest.fixture
def loud(make_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    """A daemon whose node id, a task type and a plugin's error, progress and result carry markup and escapes."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "shouting_plugins.py").write_text(SHOUTING_PLUGIN)
    daemon = make_daemon({
        "node": {"id": LOUD_NODE},
        "plugins.shout": {"python": "shouting_plugins:shout"},
        "types.shout": {"plugins": ["shout"], "max_attempts": 1},
        f"types.{json.dumps(LOUD_TYPE)}": {"plugins": ["noop"]},
    }, env={"PYTHONPATH": str(plugins)})
    daemon.start()
    return daemon


@pytest.mark.e2e
def test_show_and_submit_wait_print_a_plugins_markup_and_escapes_literally(loud: Daemon, cli: Cli) -> None:
    waited = cli("submit", "shout", "--payload", json.dumps({"msg": HOSTILE}), "--wait", "--url", loud.url, env=WIDE)
    assert waited.returncode == TASK_FAILED, waited.stderr
    task_id = waited.stdout.split()[0]
    assert_no_raw_control(waited.stdout + waited.stderr)
    assert waited.stderr.strip().splitlines()[-1] == f"{task_id} failed: RuntimeError: {SHOWN}"

    shown = cli("show", task_id, "--url", loud.url, env=WIDE)
    assert shown.returncode == OK, shown.stderr
    assert_no_raw_control(shown.stdout)
    facts = {k: v.strip() for k, v in (line.split(None, 1) for line in shown.stdout.splitlines()
                                       if line[:1].isalpha() and " " in line)}
    assert facts["error"] == f"plugin_error: RuntimeError: {SHOWN}"
    assert facts["progress"] == f"50% {SHOWN}"
    assert facts["node_id"] == LOUD_NODE_SHOWN
    assert facts["payload"] == json.dumps({"msg": HOSTILE}), "the payload as stored, markup and all"
    assert f"result shout#0: {json.dumps({'said': HOSTILE})}" in shown.stdout
    assert shown.stdout.count(f"RuntimeError: {SHOWN}") == 2, "the task's error and its attempt's"

    as_json = cli("show", task_id, "--json", "--url", loud.url)
    assert json.loads(as_json.stdout) == loud.task(task_id), "--json is the API's answer, exactly"
    assert_no_raw_control(as_json.stdout)


@pytest.mark.e2e
def test_list_pool_nodes_and_schedules_print_names_with_markup_and_escapes_literally(loud: Daemon,
                                                                                      cli: Cli) -> None:
    task_id = loud.submit(LOUD_TYPE)["id"]
    loud.wait_terminal(task_id)
    assert loud.post("/v1/schedules", {"name": "loud", "type": LOUD_TYPE, "every_s": 3600}).status == 201
    outputs = {command: cli(command, "--url", loud.url, env=WIDE) for command in ("list", "pool", "nodes", "schedules")}
    for command, result in outputs.items():
        assert result.returncode == OK, (command, result.stderr)
        assert_no_raw_control(result.stdout)
    row = next(line.split() for line in outputs["list"].stdout.splitlines() if task_id[:12] in line)
    assert row[:5] == [task_id[:12], LOUD_TYPE_SHOWN, "completed", "1/3", LOUD_NODE_SHOWN], row
    assert outputs["pool"].stdout.splitlines()[0] == f"node     {LOUD_NODE_SHOWN}"
    assert any(line.split()[:2] == [LOUD_NODE_SHOWN, "yes"] for line in outputs["nodes"].stdout.splitlines()), \
        outputs["nodes"].stdout
    (schedule,) = [line.split() for line in outputs["schedules"].stdout.splitlines() if line.split()[:1] == ["loud"]]
    assert schedule[:2] == ["loud", LOUD_TYPE_SHOWN], outputs["schedules"].stdout


@pytest.mark.e2e
def test_the_daemons_error_messages_print_what_they_quote_literally(daemon: Daemon, cli: Cli) -> None:
    for command in ("show", "cancel", "retry"):  # "task ID not found" quotes the id as it came
        result = cli(command, LOUD_TYPE, "--url", daemon.url)
        assert (result.returncode, result.stdout) == (USAGE, ""), (command, result.stderr)
        assert result.stderr == f"tidepool: task {LOUD_TYPE_SHOWN} not found (404 not_found)\n"
    unknown = cli("submit", LOUD_TYPE, "--url", daemon.url)
    assert unknown.returncode == USAGE and "unknown task type 'loud[bold]TYPE[/bold]" in unknown.stderr
    assert_no_raw_control(unknown.stderr)
