"""`tidepool workers` against a real gateway whose registry real remote workers (raw /w1 calls over mutual TLS)
filled: the table, each action's effect on the worker's record and on what it may lease, and the errors."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import TOKEN, Daemon
from .gateway_node import Gateway

Cli = Callable[..., subprocess.CompletedProcess[str]]
OK, USAGE = 0, 2


@pytest.fixture
def workers_cli(gateway: Gateway, cli: Cli, tmp_path: Path) -> Cli:
    """`tidepool workers ARGS` at the gateway's API with its token."""
    token_file = tmp_path / "cli.token"
    token_file.write_text(TOKEN)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return cli("workers", *args, "--url", gateway.daemon.url, "--token-file", str(token_file))

    return run


@pytest.mark.e2e
def test_the_table_lists_each_worker_that_called_with_its_state_and_load(gateway: Gateway, workers_cli: Cli) -> None:
    a, b = gateway.worker("scanner-a"), gateway.worker("scanner-b")
    assert a.acquire()[0] == b.acquire()[0] == 403  # manual enrollment: both recorded pending
    assert gateway.daemon.request("PATCH", "/v1/workers/scanner-a", {"state": "enabled"}).status == 200
    gateway.daemon.submit("sleep", {"seconds": 60})
    status, answer = a.acquire()
    assert status == 200 and len(answer["tasks"]) == 1, answer

    listed = workers_cli()
    assert listed.returncode == OK, listed.stderr
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[2:]}
    assert rows["scanner-a"][:6] == ["scanner-a", "enabled", "1", "16", "*", "default"]
    assert rows["scanner-b"][:3] == ["scanner-b", "pending", "0"]
    not_after = gateway.record("scanner-a")["fingerprints"][0]["not_after"]
    assert rows["scanner-a"][-2:] == [not_after[:10], not_after[11:19]]  # its certificate's end, to the second
    assert "127.0.0.1" in rows["scanner-a"]

    as_json = workers_cli("--json")
    assert as_json.returncode == OK, as_json.stderr
    assert json.loads(as_json.stdout) == gateway.daemon.get("/v1/workers").body


@pytest.mark.e2e
def test_enable_disable_and_set_change_what_the_worker_leases(gateway: Gateway, workers_cli: Cli) -> None:
    worker = gateway.worker("scanner-a")
    assert worker.acquire()[1]["error"]["code"] == "worker_pending"

    enabled = workers_cli("enable", "scanner-a")
    assert (enabled.returncode, enabled.stdout) == (OK, "worker scanner-a enabled (max 16 live, types *, "
                                                        "organizations default)\n"), enabled.stderr
    first = gateway.daemon.submit("sleep", {"seconds": 60})
    assert [t["task"]["id"] for t in worker.acquire()[1]["tasks"]] == [first["id"]]

    disabled = workers_cli("disable", "scanner-a")
    assert disabled.returncode == OK, disabled.stderr
    assert "disabled: it takes no new task; its 1 live attempt(s) run to their end" in disabled.stdout
    gateway.daemon.submit("sleep", {"seconds": 60})
    status, answer = worker.acquire()
    assert (status, answer["tasks"], answer["worker_state"]) == (200, [], "disabled")
    assert gateway.daemon.task(first["id"])["state"] == "leased"  # a drain lets it run on

    changed = workers_cli("set", "scanner-a", "--max", "3", "--types", "sleep, tcp_*", "--orgs", "acme,globex",
                          "--json")
    assert changed.returncode == OK, changed.stderr
    record = json.loads(changed.stdout)
    assert (record["max_concurrent_tasks"], record["task_types"], record["organizations"]) == (
        3, ["sleep", "tcp_*"], ["acme", "globex"])
    assert gateway.record("scanner-a") == record


@pytest.mark.e2e
def test_an_organization_taken_away_with_cancel_removed_cancels_its_attempts(gateway: Gateway,
                                                                              workers_cli: Cli) -> None:
    worker = gateway.worker("scanner-a")
    worker.acquire()
    workers_cli("enable", "scanner-a")
    task = gateway.daemon.submit("sleep", {"seconds": 60})
    assert len(worker.acquire()[1]["tasks"]) == 1

    changed = workers_cli("set", "scanner-a", "--orgs", "acme", "--cancel-removed")
    assert changed.returncode == OK, changed.stderr
    assert changed.stdout.rstrip().endswith("organizations acme); its attempts of the organizations it is not "
                                            "assigned are cancelled")
    assert gateway.daemon.task(task["id"])["state"] == "cancelling"


@pytest.mark.e2e
def test_cancel_removed_alone_cancels_the_attempts_an_earlier_set_let_run(gateway: Gateway, workers_cli: Cli) -> None:
    worker = gateway.worker("scanner-a")
    worker.acquire()
    workers_cli("enable", "scanner-a")
    task = gateway.daemon.submit("sleep", {"seconds": 60})  # of the organization "default"
    assert len(worker.acquire()[1]["tasks"]) == 1
    narrowed = workers_cli("set", "scanner-a", "--orgs", "acme", "--keep-running")
    assert narrowed.returncode == OK, narrowed.stderr
    assert gateway.daemon.task(task["id"])["state"] == "leased"  # with --keep-running it runs on

    cancelled = workers_cli("set", "scanner-a", "--cancel-removed")
    assert cancelled.returncode == OK, cancelled.stderr
    assert cancelled.stdout.rstrip().endswith("organizations acme); its attempts of the organizations it is not "
                                              "assigned are cancelled")
    assert gateway.daemon.task(task["id"])["state"] == "cancelling"
    assert gateway.record("scanner-a")["organizations"] == ["acme"]  # nothing else of the worker changed


@pytest.mark.e2e
def test_revoke_cancels_the_workers_attempts_and_is_final(gateway: Gateway, workers_cli: Cli) -> None:
    worker = gateway.worker("scanner-a")
    worker.acquire()
    workers_cli("enable", "scanner-a")
    task = gateway.daemon.submit("sleep", {"seconds": 60})
    assert len(worker.acquire()[1]["tasks"]) == 1

    revoked = workers_cli("revoke", "scanner-a")
    assert revoked.returncode == OK, revoked.stderr
    assert revoked.stdout.startswith("worker scanner-a revoked: its certificate is refused from now on; its 1 live "
                                     "attempt(s) are being cancelled")
    assert gateway.daemon.task(task["id"])["state"] == "cancelling"
    assert worker.acquire()[1]["error"]["code"] == "worker_revoked"

    again = workers_cli("enable", "scanner-a")
    assert again.returncode == USAGE
    assert again.stderr == "tidepool: worker scanner-a is revoked; a revoke is final (409 conflict)\n"
    assert gateway.record("scanner-a")["state"] == "revoked"


@pytest.mark.e2e
@pytest.mark.parametrize("args", [["enable", "nobody"], ["disable", "nobody"], ["revoke", "nobody"],
                                  ["set", "nobody", "--max", "2"]])
def test_an_unknown_worker_is_a_usage_error_naming_it(gateway: Gateway, workers_cli: Cli, args: list[str]) -> None:
    result = workers_cli(*args)
    assert result.returncode == USAGE
    assert result.stderr == "tidepool: worker 'nobody' not found (404 worker_not_found)\n"
    assert result.stdout == ""


@pytest.mark.e2e
def test_a_bad_value_is_refused_naming_the_field_and_changes_nothing(gateway: Gateway, workers_cli: Cli) -> None:
    gateway.worker("scanner-a").acquire()
    before = gateway.record("scanner-a")
    result = workers_cli("set", "scanner-a", "--max", "1", "--orgs", "acme,no spaces")
    assert result.returncode == USAGE
    assert "organizations" in result.stderr and "'no spaces'" in result.stderr and "(400 " in result.stderr
    assert gateway.record("scanner-a") == before


@pytest.mark.e2e
def test_a_node_with_no_worker_lists_an_empty_table(make_daemon: Callable[..., Daemon], cli: Cli) -> None:
    daemon = make_daemon({})
    daemon.start()
    result = cli("workers", "--url", daemon.url)
    assert result.returncode == OK, result.stderr
    assert result.stdout.split()[:2] == ["worker", "state"] and len(result.stdout.splitlines()) == 2


@pytest.mark.e2e
def test_disable_with_cancel_drains_with_a_cancel_and_set_takes_tags_and_a_reset_issuer(
        gateway: Gateway, workers_cli: Cli) -> None:
    worker = gateway.worker("scanner-a")
    worker.acquire()
    workers_cli("enable", "scanner-a")
    task = gateway.daemon.submit("sleep", {"seconds": 60})
    assert len(worker.acquire()[1]["tasks"]) == 1
    assert gateway.record("scanner-a")["issuer"] is not None  # bound to the CA of its certificate

    drained = workers_cli("disable", "scanner-a", "--cancel")
    assert drained.returncode == OK, drained.stderr
    assert "disabled: it takes no new task; its 1 live attempt(s) are being cancelled" in drained.stdout
    assert gateway.daemon.task(task["id"])["state"] == "cancelling"

    tagged = workers_cli("set", "scanner-a", "--tags", "lab-*, linux", "--reset-issuer")
    assert tagged.returncode == OK, tagged.stderr
    assert "tags lab-*,linux" in tagged.stdout
    record = gateway.record("scanner-a")
    assert (record["tags"], record["issuer"]) == (["lab-*", "linux"], None)
    assert worker.acquire()[0] == 200
    assert gateway.record("scanner-a")["issuer"] is not None  # its next certificate bound it anew
