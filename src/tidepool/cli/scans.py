"""The scan commands: `tidepool scan PROFILE` (and follow it step by step), `tidepool scans`, and a scan's
own verbs `tidepool scan show|cancel|retry ID`: what it found, and stopping or re-running its steps."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console, Group
from rich.live import Live
from rich.pretty import Pretty
from rich.table import Column, Table
from rich.text import Text

from ..client import ApiError, Client, Unreachable
from ..settings import Settings
from ..settings.profiles import SCAN_VERBS
from .files import InputError, add_input_option, parse_inputs, upload_inputs
from .output import (
    ERR,
    OK,
    STYLE,
    TASK_FAILED,
    USAGE,
    fact,
    print_json,
    result_line,
    stdout,
    table,
    text,
    visible,
    when,
)
from .talk import with_client

SCAN_ENDED = frozenset({"succeeded", "failed", "cancelled"})
SCAN_STYLE = {**STYLE, "succeeded": "green", "success": "green", "timeout": "red", "skipped": "dim",
              "waiting": "dim"}
REREAD_S = 1.0  # while waiting: the scan is read again this often even when no event of it came


def cmd_scan(args: argparse.Namespace, settings: Settings) -> int:
    try:
        payload = _payload(args.payload)
    except (OSError, ValueError) as exc:
        print(f"tidepool: --payload: {exc}", file=sys.stderr)
        return USAGE
    try:
        files = parse_inputs(args.input)
    except InputError as exc:
        print(f"tidepool: {exc}", file=sys.stderr)
        return USAGE

    async def body(client: Client) -> int:
        inputs = await upload_inputs(client, files)
        scan = await client.submit_scan(args.profile, payload, priority=args.priority, organization=args.organization,
                                        idempotency_key=args.key, inputs=inputs or None)
        print(visible(scan["id"]))
        if not args.wait:
            return OK
        # On a terminal the lines change in place; piped, the last of them is written once, whole.
        console = ERR if sys.stderr.isatty() else Console(stderr=True, width=10_000)
        with Live(steps_view(scan), console=console, refresh_per_second=8) as live:
            final = await follow(client, scan["id"], on_change=lambda seen: live.update(steps_view(seen)))
        return OK if final["state"] == "succeeded" else TASK_FAILED

    return with_client(args, settings, body)


def _payload(given: str) -> Any:
    raw = Path(given[1:]).read_text() if given.startswith("@") else given
    payload = json.loads(raw)
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object, not {type(payload).__name__}")
    return payload


async def follow(client: Client, scan_id: str, *, on_change: Callable[[dict[str, Any]], None],
                 reread_s: float = REREAD_S) -> dict[str, Any]:
    """Until the scan has ended: its events wake a read of it, and it is read every `reread_s` whatever
    came (a step's task may run on another node of a fleet, whose events this daemon does not stream)."""
    woken = anyio.Event()

    async def listen() -> None:
        nonlocal woken
        with contextlib.suppress(ApiError, Unreachable):  # no stream (a full daemon, a proxy): reads alone do
            async for event in client.events(types="scan.*"):
                if event.get("scan_id") == scan_id or event["event"] == "stream.connected":
                    woken.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            while True:
                scan = await client.get_scan(scan_id)
                on_change(scan)
                if scan["state"] in SCAN_ENDED:
                    tg.cancel_scope.cancel()
                    break
                with anyio.move_on_after(reread_s):
                    await woken.wait()
                woken = anyio.Event()
    except BaseExceptionGroup as group:  # a read that failed (the listener keeps its own): as with_client knows it
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return scan


def steps_view(scan: dict[str, Any]) -> Group:
    """The scan's head line, then one line per step: its index, type, state, attempts, task and error."""
    head = Text.assemble(text(f"scan {scan['id']} {scan['profile']} "),
                         text(scan["state"], SCAN_STYLE.get(scan["state"], "")))
    lines = [head]
    for job in scan["jobs"]:
        error = f"  {job['error']['code']}: {job['error']['message']}" if job.get("error") else ""
        line = f"  {job['index']:>2} {visible(job['step']):<16} {job['state']:<10} attempts {job['attempts']:<3} " \
               f"task {job['task_id'] or '-'}{visible(error)}"
        lines.append(Text(line[:200], style=SCAN_STYLE.get(job["state"], ""), no_wrap=True, overflow="ellipsis"))
    return Group(*lines)


def cmd_scans(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        page = await client.list_scans(state=args.state, profile=args.profile, limit=args.limit, cursor=args.cursor)
        if args.json:
            print_json(page)
            return OK
        rows = table(Column("id", no_wrap=True), Column("profile", no_wrap=True), Column("state", no_wrap=True),
                     "steps", "created (UTC)", "finished (UTC)")
        for scan in page["scans"]:
            steps = Text(" ").join(Text(visible(f"{job['step']}:{job['state']}"),
                                        style=SCAN_STYLE.get(job["state"], "")) for job in scan["jobs"])
            rows.add_row(text(scan["id"]), text(scan["profile"]),
                         text(scan["state"], SCAN_STYLE.get(scan["state"], "")), steps,
                         text(when(scan["created_at"])), text(when(scan["finished_at"])))
        stdout().print(rows)
        if page["next_cursor"]:  # on stderr, as `tidepool list` says it: a pipe gets the rows alone
            print(visible(f"more scans: the next page is `tidepool scans --cursor {page['next_cursor']}` with the "
                          "same --state, --profile and --limit"), file=sys.stderr)
        return OK

    return with_client(args, settings, body)


def cmd_scan_show(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        scan = await client.get_scan(args.scan_id)
        tasks = [await client.get(job["task_id"]) for job in scan["jobs"] if job["task_id"]]
        if args.json:
            print_json({**scan, "tasks": tasks})
            return OK
        console = stdout()
        facts = Table.grid(padding=(0, 2))
        for key in ("id", "profile", "state", "organization", "payload", "created_at", "finished_at"):
            facts.add_row(key, text(fact(key, scan[key]), SCAN_STYLE.get(scan[key], "") if key == "state" else ""))
        console.print(facts)
        steps = Table("#", "step", "state", "attempts", "task", "error", "artifacts", title="steps")
        for job in scan["jobs"]:
            steps.add_row(*map(text, (str(job["index"]), job["step"], job["state"], str(job["attempts"]),
                                      job["task_id"] or "-", fact("error", job["error"]),
                                      " ".join(job.get("artifacts", {})) or "-")),
                          style=SCAN_STYLE.get(job["state"], ""))
        console.print(steps)
        for name, sha256 in scan.get("inputs", {}).items():
            console.print(text(f"input {name} sha256 {sha256}"))
        console.print(text("found (the scope its steps handed on):"))
        console.print(Pretty(scan["scope"], indent_guides=False) if scan["scope"] else text("  nothing yet"))
        for task in tasks:
            for r in task["results"]:
                console.print(text(f"result of {task['type']} ({task['id']}) {result_line(r)}"))
        return OK

    return with_client(args, settings, body)


def cmd_scan_cancel(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        print(visible(await client.cancel_scan(args.scan_id)))
        return OK

    return with_client(args, settings, body)


def cmd_scan_retry(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        scan = await client.retry_job(args.scan_id, args.index)
        job = scan["jobs"][args.index]
        print(visible(f"{scan['id']} {scan['state']}: step {job['index']} {job['step']} {job['state']}, "
                      f"task {job['task_id'] or '-'}"))
        return OK

    return with_client(args, settings, body)


def verb_first(argv: list[str]) -> list[str]:
    """`scan show ID` as the parser knows it, one command named "scan show": `scan PROFILE` keeps its
    positional profile, which no subparser could share with the verbs."""
    if len(argv) >= 2 and argv[0] == "scan" and argv[1] in SCAN_VERBS:
        return [f"scan {argv[1]}", *argv[2:]]
    return argv


def add_commands(add: Any) -> None:
    p = add("scan", cmd_scan, "start a scan of a profile and print its id")
    p.add_argument("profile")
    p.add_argument("--payload", default="{}", help="JSON, or @FILE")
    p.add_argument("--priority", type=int)
    p.add_argument("--organization")
    p.add_argument("--key", help="idempotency key")
    add_input_option(p)
    p.add_argument("--wait", action="store_true",
                   help="follow the scan step by step to its end; exit 1 unless it succeeded")
    p = add("scans", cmd_scans, "list scans with their steps, newest first", json=True)
    p.add_argument("--state", help="pending, running, succeeded, failed or cancelled")
    p.add_argument("--profile")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--cursor", help="the next page: the cursor a page before ended with")
    p = add("scan show", cmd_scan_show, "show one scan: its steps, what they found and each step's results", json=True)
    p.add_argument("scan_id")
    add("scan cancel", cmd_scan_cancel, "cancel a scan: its running step is cancelled, the rest skipped"
        ).add_argument("scan_id")
    p = add("scan retry", cmd_scan_retry, "run a failed, timed-out or cancelled step of a scan again, and the "
            "steps after it")
    p.add_argument("scan_id")
    p.add_argument("index", type=int, help="the step's index, as `scan show` numbers them")
