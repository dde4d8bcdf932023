"""Every action from the CLI against a live daemon: schedules, the token file, the address forms, task ids by
prefix, and what config check says it read. Exit codes as the documentation states them: 0 done, 2 a refusal of the
request or the token, 3 no daemon answered."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Daemon, free_port, to_toml

Cli = Callable[..., subprocess.CompletedProcess[str]]
OK, USAGE, UNREACHABLE = 0, 2, 3
pytestmark = pytest.mark.e2e


def _schedule(daemon: Daemon, name: str) -> dict[str, object]:
    return next(s for s in daemon.get("/v1/schedules").body["schedules"] if s["name"] == name)


def test_schedules_add_pause_resume_delete_each_change_the_daemons_schedule(daemon: Daemon, cli: Cli) -> None:
    added = cli("schedules", "add", "hourly", "noop", "--every", "3600", "--payload", '{"k": 1}', "--url", daemon.url)
    assert added.returncode == OK, added.stderr
    assert added.stdout.startswith("schedule hourly saved, next run ")
    saved = _schedule(daemon, "hourly")
    assert (saved["type"], saved["every_s"], saved["payload"], saved["paused"]) == ("noop", 3600.0, {"k": 1}, False)

    nightly = cli("schedules", "add", "nightly", "noop", "--cron", "0 2 * * *", "--timezone", "Europe/Paris",
                  "--overlap", "skip", "--url", daemon.url)
    assert nightly.returncode == OK, nightly.stderr
    assert (_schedule(daemon, "nightly")["cron"], _schedule(daemon, "nightly")["timezone"]) == ("0 2 * * *",
                                                                                                "Europe/Paris")
    paused = cli("schedules", "pause", "hourly", "--url", daemon.url)
    assert (paused.returncode, paused.stdout.strip()) == (OK, "schedule hourly paused"), paused.stderr
    assert _schedule(daemon, "hourly")["paused"] is True
    listed = cli("schedules", "--url", daemon.url).stdout
    assert any(line.split()[:1] == ["hourly"] and " paused " in line for line in listed.splitlines()), listed
    resumed = cli("schedules", "--url", daemon.url, "resume", "hourly")  # options before the action too
    assert resumed.returncode == OK and _schedule(daemon, "hourly")["paused"] is False, resumed.stderr
    deleted = cli("schedules", "delete", "hourly", "--url", daemon.url)
    assert deleted.returncode == OK, deleted.stderr
    assert [s["name"] for s in daemon.get("/v1/schedules").body["schedules"]] == ["nightly"]


@pytest.mark.parametrize(("args", "says"), [
    (["add", "x", "no-such-type", "--every", "60"], "no-such-type"),
    (["add", "x", "noop", "--every", "0.5"], "every_s"),
    (["add", "x", "noop", "--cron", "not cron"], "cron"),
    (["add", "x", "noop", "--every", "60", "--payload", "{nope"], "--payload"),
    (["pause", "nosuch"], "nosuch"),
    (["resume", "nosuch"], "nosuch"),
    (["delete", "nosuch"], "nosuch"),
])
def test_a_schedule_the_daemon_refuses_is_exit_2_naming_what_is_wrong(daemon: Daemon, cli: Cli, args: list[str],
                                                                      says: str) -> None:
    result = cli("schedules", *args, "--url", daemon.url)
    assert result.returncode == USAGE, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert daemon.get("/v1/schedules").body["schedules"] == []


def test_schedules_add_needs_exactly_one_of_every_and_cron(daemon: Daemon, cli: Cli) -> None:
    for when in ([], ["--every", "60", "--cron", "@daily"]):
        result = cli("schedules", "add", "x", "noop", *when, "--url", daemon.url)
        assert result.returncode == USAGE and "--every" in result.stderr, result.stderr


def test_schedules_actions_exit_3_when_no_daemon_answers(cli: Cli) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["add", "x", "noop", "--every", "60"], ["pause", "x"], ["resume", "x"], ["delete", "x"]):
        result = cli("schedules", *args, "--url", url)
        assert result.returncode == UNREACHABLE, (args, result.stderr)
        assert "ssl:default" not in result.stderr and "Connection refused" in result.stderr, result.stderr


def test_token_file_on_every_command_and_a_401_says_where_the_token_came_from(
        make_daemon: Callable[..., Daemon], cli: Cli, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    daemon = make_daemon({"api": {"token_file": str(token)}})
    daemon.start()
    for args in (["pool"], ["list"], ["nodes"], ["schedules"], ["submit", "noop"]):
        result = cli(*args, "--url", daemon.url, "--token-file", str(token))
        assert result.returncode == OK, (args, result.stderr)
    unsent = cli("pool", "--url", daemon.url)
    assert unsent.returncode == USAGE, unsent.stderr
    assert "401" in unsent.stderr and "no token was sent" in unsent.stderr and "--token-file" in unsent.stderr
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n")
    refused = cli("pool", "--url", daemon.url, "--token-file", str(wrong))
    assert refused.returncode == USAGE and f"read from {wrong} (--token-file)" in refused.stderr, refused.stderr
    config = tmp_path / "client.toml"
    config.write_text(to_toml({"api": {"listen": f"127.0.0.1:{daemon.port}", "token_file": str(wrong)}}))
    from_config = cli("pool", "--config", str(config))
    assert from_config.returncode == USAGE and f"api.token_file of {config}" in from_config.stderr, from_config.stderr
    missing = cli("pool", "--url", daemon.url, "--token-file", str(tmp_path / "none"))
    assert missing.returncode == USAGE and "--token-file" in missing.stderr, missing.stderr
    schedule = cli("schedules", "add", "x", "noop", "--every", "60", "--url", daemon.url, "--token-file", str(token))
    assert schedule.returncode == OK, schedule.stderr


def test_url_takes_what_api_listen_takes(daemon: Daemon, cli: Cli) -> None:
    for url in (f"127.0.0.1:{daemon.port}", f":{daemon.port}", f"0.0.0.0:{daemon.port}", daemon.url):
        result = cli("pool", "--url", url)
        assert result.returncode == OK, (url, result.stderr)
    bad = cli("pool", "--url", "127.0.0.1:99999")
    assert bad.returncode == USAGE and bad.stderr.startswith("tidepool: --url: "), bad.stderr


def test_a_unix_socket_address_without_a_daemon_is_unreachable_in_words(cli: Cli, tmp_path: Path) -> None:
    result = cli("pool", "--url", f"unix:{tmp_path / 'api.sock'}")
    assert result.returncode == UNREACHABLE, result.stderr
    assert result.stderr.strip().endswith("cannot connect: No such file or directory"), result.stderr


def test_a_task_is_named_by_a_unique_prefix_of_its_id_and_listed_by_a_short_form(daemon: Daemon, cli: Cli) -> None:
    task_id = cli("submit", "noop", "--wait", "--url", daemon.url).stdout.split()[0]
    other = cli("submit", "sleep", "--payload", '{"seconds": 30}', "--url", daemon.url).stdout.split()[0]
    shown = cli("show", task_id[:12], "--url", daemon.url, "--json")
    assert shown.returncode == OK and f'"id": "{task_id}"' in shown.stdout, shown.stderr
    cancelled = cli("cancel", other[:14], "--url", daemon.url)
    assert (cancelled.returncode, cancelled.stdout.split()) in ((OK, ["cancelling"]), (OK, ["cancelled"])), \
        cancelled.stderr
    listed = [line.split()[0] for line in cli("list", "--url", daemon.url).stdout.splitlines()[2:] if line.strip()]
    assert sorted(listed) == sorted([task_id[:12], other[:12]]), "submitted apart: their milliseconds tell them apart"
    common = next(n for n in range(32) if task_id[n] != other[n])
    assert common >= 4, "made seconds apart, their ids share their first digits"
    ambiguous = cli("show", task_id[:common], "--url", daemon.url)
    assert ambiguous.returncode == USAGE and "ambiguous" in ambiguous.stderr, ambiguous.stderr
    unknown = cli("show", "ffff", "--url", daemon.url)
    assert unknown.returncode == USAGE and "task ffff not found" in unknown.stderr, unknown.stderr


def test_config_check_says_which_file_it_read(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "good.toml"
    path.write_text(to_toml({"pool": {"min_workers": 3}}))
    given = cli("config", "check", "--config", str(path))
    assert given.returncode == OK and f"config read from {path} (--config)" in given.stderr, given.stderr
    none = cli("config", "check")
    assert none.returncode == OK and "no config file found" in none.stderr, none.stderr
    assert "config/tidepool.toml" in none.stderr and "/etc/tidepool/tidepool.toml" in none.stderr


def test_show_list_and_the_attempts_table_agree_on_the_attempt_after_a_retry(daemon: Daemon, cli: Cli) -> None:
    """`attempt` counts the budget (a retry by request starts a new one); `#` numbers every row."""
    failed = cli("submit", "sleep", "--payload", '{"seconds": "x"}', "--max-attempts", "2", "--wait", "--url",
                 daemon.url)
    task_id = failed.stdout.split()[0]
    assert cli("retry", task_id, "--url", daemon.url).returncode == OK
    daemon.wait_terminal(task_id)
    shown = cli("show", task_id, "--url", daemon.url, env={"COLUMNS": "200"}).stdout
    facts = dict(line.split(None, 1) for line in shown.splitlines() if line[:1].isalpha() and " " in line)
    assert facts["attempt"].strip() == "1/2", shown
    rows = [line.split("│")[1:3] for line in shown.splitlines() if line.count("│") > 3 and "failed" in line]
    assert [[cell.strip() for cell in row] for row in rows] == [["1", "-"], ["2", "1/2"]], shown
    listed = next(line.split() for line in cli("list", "--url", daemon.url).stdout.splitlines()
                  if line.split()[:1] and task_id.startswith(line.split()[0]))
    assert listed[3] == "1/2", listed
