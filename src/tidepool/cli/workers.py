"""`tidepool workers`: the remote workers a gateway knows, and the operator's say over each one (enable, drain,
revoke, what it may take, the CA its identity is bound to)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from rich.table import Column

from ..client import Client
from ..settings import Settings
from .output import OK, USAGE, print_json, stdout, table, text, visible, when
from .talk import add_client_options, read_and_print, with_client

STATE_STYLE = {"enabled": "green", "pending": "yellow", "disabled": "yellow", "revoked": "red"}


def cmd_workers(args: argparse.Namespace, settings: Settings) -> int:
    return read_and_print(args, settings, lambda client: client.request("GET", "/v1/workers"), print_workers)


def print_workers(data: dict[str, Any]) -> None:
    rows = table(Column("worker", no_wrap=True), Column("state", no_wrap=True), "live", "max", "types",
                 "organizations", "slots", "version", "last seen (UTC)", "address", "certificate until (UTC)")
    for w in data["workers"]:
        rows.add_row(text(w["id"]), text(w["state"], STATE_STYLE.get(w["state"], "")),
                     *map(text, (str(live_count(w)), str(w["max_concurrent_tasks"]), ",".join(w["task_types"]),
                                 ",".join(w["organizations"]), slots(w), w.get("version") or "-",
                                 when(w.get("last_seen")), w.get("address") or "-", when(latest_not_after(w)))))
    stdout().print(rows)


def live_count(worker: dict[str, Any]) -> int:
    """How many attempts the worker holds leased or running: the record lists them, or counts them."""
    live = worker.get("live") or 0
    return len(live) if isinstance(live, list) else int(live)


def slots(worker: dict[str, Any]) -> str:
    """The slot tag sets it last reported, as `tidepool nodes` writes a node's: "win10,gpu; linux"."""
    return "; ".join(",".join(tags) for tags in worker.get("slots") or []) or "-"


def latest_not_after(worker: dict[str, Any]) -> str | None:
    """When its newest certificate expires: until then it can connect, whatever older ones it rotated from."""
    ends = [f["not_after"] for f in worker.get("fingerprints") or [] if f.get("not_after")]
    return max(ends) if ends else None


def cmd_enable(args: argparse.Namespace, settings: Settings) -> int:
    return _change(args, settings, "PATCH", "", {"state": "enabled"})


def cmd_disable(args: argparse.Namespace, settings: Settings) -> int:
    change: dict[str, Any] = {"state": "disabled"}
    if args.cancel:
        change["cancel_running"] = True
    return _change(args, settings, "PATCH", "", change)


def cmd_revoke(args: argparse.Namespace, settings: Settings) -> int:
    return _change(args, settings, "POST", "/revoke", None)


def cmd_set(args: argparse.Namespace, settings: Settings) -> int:
    change: dict[str, Any] = {}
    if args.max is not None:
        change["max_concurrent_tasks"] = args.max
    if args.types is not None:
        change["task_types"] = _names(args.types)
    if args.orgs is not None:
        change["organizations"] = _names(args.orgs)
    if args.tags is not None:
        change["tags"] = _names(args.tags)
    if args.reset_issuer:
        change["reset_issuer"] = True
    if args.cancel_removed:  # alone too: the attempts of organizations an earlier set took away
        change["cancel_removed"] = True
    if args.keep_running:
        change["cancel_removed"] = False
    if not change:
        print("tidepool: workers set: give at least one of --max, --types, --orgs and --cancel-removed (or --tags, "
              "--reset-issuer, --keep-running)", file=sys.stderr)
        return USAGE
    return _change(args, settings, "PATCH", "", change)


def _names(given: str) -> list[str]:
    return [name.strip() for name in given.split(",") if name.strip()]


def _change(args: argparse.Namespace, settings: Settings, method: str, action: str,
            change: dict[str, Any] | None) -> int:
    path = f"/v1/workers/{quote(args.worker_id, safe='')}{action}"

    async def body(client: Client) -> int:
        worker = await client.request(method, path, change)
        if args.json:
            print_json(worker)
        else:
            print(visible(said(worker, cancel_removed=_cancels_removed(change),
                               cancel_running=bool(change and change.get("cancel_running")))))
        return OK

    return with_client(args, settings, body)


def _cancels_removed(change: dict[str, Any] | None) -> bool:
    """Whether a change cancels the attempts of organizations the worker is not assigned: when it says so, or
    by default when it takes organizations away."""
    if not change:
        return False
    return bool(change.get("cancel_removed", "organizations" in change))


def said(worker: dict[str, Any], *, cancel_removed: bool = False, cancel_running: bool = False) -> str:
    """One line on what the worker is now and what that means for its attempts."""
    live, state = live_count(worker), worker["state"]
    head = f"worker {worker['id']} {state}"
    if state == "disabled" and cancel_running:
        head += f": it takes no new task; its {live} live attempt(s) are being cancelled"
    elif state == "disabled":
        head += f": it takes no new task; its {live} live attempt(s) run to their end"
    elif state == "revoked":
        head += f": its certificate is refused from now on; its {live} live attempt(s) are being cancelled"
    elif state == "pending":
        head += ": it takes nothing until enabled"
    settings_ = (f"max {worker['max_concurrent_tasks']} live, types {','.join(worker['task_types']) or '-'}, "
                 f"organizations {','.join(worker['organizations']) or '-'}")
    if worker.get("tags", ["*"]) != ["*"]:
        settings_ += f", tags {','.join(worker['tags']) or '-'}"
    tail = "; its attempts of the organizations it is not assigned are cancelled" if cancel_removed else ""
    return f"{head} ({settings_}){tail}"


def add_commands(add: Any) -> None:
    parent = add("workers", cmd_workers, "the gateway's remote workers; enable, disable, revoke or set one",
                 json=True)
    actions = parent.add_subparsers(dest="action", metavar="{enable,disable,revoke,set}")

    def action(name: str, func: Any, help_text: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = actions.add_parser(name, help=help_text)
        p.add_argument("--config", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        add_client_options(p, default=argparse.SUPPRESS)
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="print the worker's record as JSON")
        p.set_defaults(func=func)
        p.add_argument("worker_id", metavar="ID", help="the worker's identity: its certificate's common name")
        return p

    action("enable", cmd_enable, "let it take tasks (a pending worker's enrollment)")
    p = action("disable", cmd_disable, "drain it: no new tasks, its running attempts finish (or --cancel)")
    p.add_argument("--cancel", action="store_true", help="cancel its running attempts too (a drain with a cancel)")
    action("revoke", cmd_revoke, "refuse it for good: its attempts are cancelled, its connections closed")
    p = action("set", cmd_set, "change what it may take; cancel what it may no longer take")
    p.add_argument("--max", type=int, metavar="N", help="the most attempts it may hold at once")
    p.add_argument("--types", metavar="A,B", help="the task types it may take (globs), comma separated")
    p.add_argument("--orgs", metavar="A,B", help="the organizations whose tasks it may take, comma separated")
    p.add_argument("--tags", metavar="A,B", help="the slot tags that count for it (globs), comma separated: the tags "
                                                "it reports lease only the tasks these allow")
    p.add_argument("--reset-issuer", action="store_true",
                   help="let its next certificate bind its identity to that certificate's CA (a CA rotation)")
    removed = p.add_mutually_exclusive_group()
    removed.add_argument("--cancel-removed", action="store_true",
                         help="cancel its active attempts of every organization it is not assigned (after --orgs, if "
                              "given), also of those an earlier set let run; --orgs alone cancels those of the "
                              "organizations it takes away")
    removed.add_argument("--keep-running", action="store_true",
                         help="with --orgs: its active attempts of the organizations taken away run to their end")
