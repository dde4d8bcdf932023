"""`tidepool schedules`: list them, and add, pause, resume or delete one."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from rich.table import Column

from ..client import Client
from ..settings import Settings
from .output import OK, USAGE, stdout, table, text, visible, when
from .talk import add_client_options, read_and_print, with_client


def cmd_schedules(args: argparse.Namespace, settings: Settings) -> int:
    return read_and_print(args, settings, lambda client: client.request("GET", "/v1/schedules"), _print_schedules)


def _print_schedules(data: dict[str, Any]) -> None:
    rows = table(Column("name", no_wrap=True), "type", "when", "next run (UTC)", "last run (UTC)", "last task")
    for s in data["schedules"]:
        every = s["cron"] or f"every {s['every_s']:g}s"
        next_run = "paused" if s["paused"] else when(s["next_run_at"])
        last = f"{s['last_task_id'] or '-'} {s['last_task_state'] or ''}".strip()
        if s.get("profile"):  # it starts scans: its last is a scan
            last = f"scan {s['last_scan_id'] or '-'} {s['last_scan_state'] or ''}".strip()
        runs = s["type"] or f"profile {s['profile']}"
        rows.add_row(*map(text, (s["name"], runs, every, next_run, when(s["last_run_at"]), last)))
    stdout().print(rows)


def cmd_add(args: argparse.Namespace, settings: Settings) -> int:
    try:
        payload = json.loads(args.payload)
    except ValueError as exc:
        print(f"tidepool: --payload: {exc}", file=sys.stderr)
        return USAGE
    schedule: dict[str, Any] = {"name": args.name, "type": args.type, "profile": args.profile, "payload": payload,
                                "cron": args.cron, "every_s": args.every}
    for key in ("timezone", "jitter_s", "catch_up", "overlap", "priority"):
        if (value := getattr(args, key)) is not None:
            schedule[key] = value

    async def body(client: Client) -> int:
        saved = await client.request("POST", "/v1/schedules", {k: v for k, v in schedule.items() if v is not None})
        print(visible(f"schedule {saved['name']} saved, next run {when(saved['next_run_at'])} UTC"))
        return OK

    return with_client(args, settings, body)


def cmd_pause(args: argparse.Namespace, settings: Settings) -> int:
    return _act(args, settings, "POST", "pause", "paused")


def cmd_resume(args: argparse.Namespace, settings: Settings) -> int:
    return _act(args, settings, "POST", "resume", "resumed")


def cmd_delete(args: argparse.Namespace, settings: Settings) -> int:
    return _act(args, settings, "DELETE", "", "deleted")


def _act(args: argparse.Namespace, settings: Settings, method: str, action: str, done: str) -> int:
    path = f"/v1/schedules/{quote(args.name, safe='')}" + (f"/{action}" if action else "")

    async def body(client: Client) -> int:
        await client.request(method, path)
        print(visible(f"schedule {args.name} {done}"))
        return OK

    return with_client(args, settings, body)


def add_commands(add: Any) -> None:
    parent = add("schedules", cmd_schedules, "schedules with next/last run and last task state; add, pause, "
                 "resume or delete one", json=True)
    actions = parent.add_subparsers(dest="action", metavar="{add,pause,resume,delete}")

    def action(name: str, func: Any, help_text: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = actions.add_parser(name, help=help_text)
        p.add_argument("--config", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        add_client_options(p, default=argparse.SUPPRESS)
        p.set_defaults(func=func)
        p.add_argument("name")
        return p

    p = action("add", cmd_add, "create or replace a schedule: POST /v1/schedules")
    p.add_argument("type", nargs="?", help="the task type each tick submits (or give --profile)")
    p.add_argument("--profile", help="start a scan of this profile at each tick, instead of a task")
    when_ = p.add_mutually_exclusive_group(required=True)
    when_.add_argument("--every", type=float, metavar="S", help="a tick every S seconds (at least 1)")
    when_.add_argument("--cron", metavar="EXPR", help='minute hour day month weekday, e.g. "0 2 * * *", or @daily')
    p.add_argument("--payload", default="{}", help="the JSON payload of each tick's task")
    p.add_argument("--timezone", help="the zone a cron expression is read in (default UTC)")
    p.add_argument("--jitter", dest="jitter_s", type=float, metavar="S", help="start each tick up to S s later")
    p.add_argument("--catch-up", choices=["none", "last", "all"], help="after downtime (default last)")
    p.add_argument("--overlap", choices=["allow", "skip"], help="skip: no new run while one is unfinished")
    p.add_argument("--priority", type=int)
    action("pause", cmd_pause, "no ticks until resumed")
    action("resume", cmd_resume, "ticks again from the next one due")
    action("delete", cmd_delete, "remove an API-made schedule")
