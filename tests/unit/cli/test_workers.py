"""What `tidepool workers` prints from a gateway's worker records, and the requests its actions refuse to send."""

from __future__ import annotations

from typing import Any

import pytest

from tidepool import cli
from tidepool.cli.workers import print_workers, said


def record(**fields: Any) -> dict[str, Any]:
    """A worker record as GET /v1/workers answers it."""
    return {"id": "scanner-a", "state": "enabled", "max_concurrent_tasks": 16, "task_types": ["*"],
            "organizations": ["default"], "slots": [], "version": "0.9.0", "fingerprints": [],
            "first_seen": "2025-03-01T10:00:00.123456Z", "last_seen": "2025-03-02T11:22:33.987654Z",
            "address": "10.1.2.3", "live": [], **fields}


def rows(capsys: pytest.CaptureFixture[str], *workers: dict[str, Any]) -> list[list[str]]:
    print_workers({"workers": list(workers)})
    lines = capsys.readouterr().out.splitlines()
    return [line.split() for line in lines[2:]]  # after the header and its rule


def test_each_worker_is_one_row_of_its_state_load_and_what_it_may_take(capsys: pytest.CaptureFixture[str]) -> None:
    lease = {"attempt_id": "a1", "task_id": "t1"}
    busy = record(id="scanner-b", state="disabled", live=[lease, {**lease, "attempt_id": "a2"}],
                  max_concurrent_tasks=4, task_types=["tcp_*", "http_probe"], organizations=["acme", "globex"],
                  slots=[["win10", "gpu"], ["linux"]],
                  fingerprints=[{"fingerprint": "ab" * 32, "not_after": "2026-01-01T00:00:00Z"},
                                {"fingerprint": "cd" * 32, "not_after": "2027-06-30T12:00:00Z"}])
    assert rows(capsys, record(), busy) == [
        ["scanner-a", "enabled", "0", "16", "*", "default", "-", "0.9.0", "2025-03-02", "11:22:33", "10.1.2.3", "-"],
        ["scanner-b", "disabled", "2", "4", "tcp_*,http_probe", "acme,globex", "win10,gpu;", "linux", "0.9.0",
         "2025-03-02", "11:22:33", "10.1.2.3", "2027-06-30", "12:00:00"],  # the newest certificate's end
    ]


def test_a_pending_worker_that_never_reported_shows_dashes_not_none(capsys: pytest.CaptureFixture[str]) -> None:
    fresh = record(state="pending", version=None, slots=None, address=None, live=0)
    [row] = rows(capsys, fresh)
    assert row[:2] == ["scanner-a", "pending"] and row[2] == "0"
    assert "None" not in " ".join(row)


def test_a_worker_id_from_a_certificate_is_printed_literally(capsys: pytest.CaptureFixture[str]) -> None:
    """A common name is whatever the certificate's issuer wrote: no markup, no escape sequence reaches the screen."""
    print_workers({"workers": [record(id="[bold red]x[/] \x1b[2J\x1b]0;t\x07", organizations=["o\rrg"])]})
    out = capsys.readouterr().out
    assert "[bold red]x[/] \\u001b[2J\\u001b]0;t\\u0007" in out and "o\\u000drg" in out
    assert "\x1b" not in out and "\r" not in out


@pytest.mark.parametrize(("state", "live", "line"), [
    ("enabled", [], "worker scanner-a enabled (max 16 live, types *, organizations default)"),
    ("disabled", [{}, {}], "worker scanner-a disabled: it takes no new task; its 2 live attempt(s) run to their end "
                           "(max 16 live, types *, organizations default)"),
    ("revoked", [{}], "worker scanner-a revoked: its certificate is refused from now on; its 1 live attempt(s) are "
                      "being cancelled (max 16 live, types *, organizations default)"),
    ("pending", [], "worker scanner-a pending: it takes nothing until enabled "
                    "(max 16 live, types *, organizations default)"),
])
def test_an_action_says_what_the_worker_is_now(state: str, live: list[Any], line: str) -> None:
    assert said(record(state=state, live=live)) == line


def test_set_says_when_the_attempts_of_removed_organizations_are_cancelled() -> None:
    assert said(record(organizations=["acme"]), cancel_removed=True).endswith(
        "organizations acme); its attempts of the organizations it is not assigned are cancelled")


def test_a_set_that_would_change_nothing_is_a_usage_error_before_any_request(
        capsys: pytest.CaptureFixture[str]) -> None:
    # no daemon listens at this address: the command would exit 3 if it tried to reach one
    assert cli.main(["workers", "set", "scanner-a", "--url", "http://127.0.0.1:9"]) == cli.USAGE
    assert "give at least one of --max, --types, --orgs and --cancel-removed" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--cancel-removed"], ["--max", "3", "--cancel-removed"]])
def test_cancel_removed_without_orgs_is_a_request(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # no daemon listens at this address: a command that sends its request exits 3, one refused before it 2
    assert cli.main(["workers", "set", "scanner-a", *args, "--url", "http://127.0.0.1:9"]) == cli.UNREACHABLE
    assert "give" not in capsys.readouterr().err
