"""The task commands: submit (and follow), show, list, cancel, retry."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.live import Live
from rich.table import Column, Table
from rich.text import Text

from ..client import Client
from ..settings import Settings
from .files import InputError, add_input_option, artifact_rows, parse_inputs, upload_inputs
from .ids import resolve, short_forms
from .output import (
    ERR,
    OK,
    STYLE,
    TASK_FAILED,
    USAGE,
    fact,
    percent,
    print_json,
    result_line,
    stdout,
    table,
    text,
    took,
    visible,
    when,
)
from .talk import with_client


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    try:
        raw = Path(args.payload[1:]).read_text() if args.payload.startswith("@") else args.payload
        payload = json.loads(raw)
    except (OSError, ValueError) as exc:
        print(f"tidepool: --payload: {exc}", file=sys.stderr)
        return USAGE
    tags = [t.strip() for t in (args.tags or "").split(",") if t.strip()]
    try:
        files = parse_inputs(args.input)
    except InputError as exc:
        print(f"tidepool: {exc}", file=sys.stderr)
        return USAGE

    async def body(client: Client) -> int:
        inputs = await upload_inputs(client, files)
        task = await client.submit(args.type, payload, priority=args.priority, max_attempts=args.max_attempts,
                                   idempotency_key=args.key, required_tags=tags or None,
                                   organization=args.organization, inputs=inputs or None)
        print(visible(task["id"]))
        if not args.wait:
            return OK
        progress = Progress(task["id"])
        with Live(progress.render(), console=ERR, transient=True, refresh_per_second=8) as live:
            final = await client.wait(task["id"], on_change=lambda seen: live.update(progress.see(seen)))
        error = f": {final['error']['message']}" if final["error"] else ""
        ERR.print(Text.assemble(text(f"{final['id']} "), text(final["state"], STYLE.get(final["state"], "")),
                                text(error)))
        return OK if final["state"] == "completed" else TASK_FAILED

    return with_client(args, settings, body)


class Progress:
    """The live line of `submit --wait`: state, phase, plugin and fraction, from the task's events."""

    def __init__(self, task_id: str) -> None:
        self.task_id, self.state, self.phase, self.plugin = task_id, "pending", "", ""
        self.fraction: float | None = None
        self.message = ""

    def see(self, seen: dict[str, Any]) -> Text:
        event = seen.get("event")
        if event is None:  # the task itself
            self.state, self.phase = seen["state"], seen["phase"] or ""
            if seen["progress"]:
                self.fraction, self.message = seen["progress"].get("fraction"), seen["progress"].get("message", "")
        elif event in ("task.leased", "task.retry_scheduled"):  # a new attempt starts from nothing
            self.state = "leased" if event == "task.leased" else "retry_wait"
            self.phase, self.plugin, self.fraction, self.message = "", "", None, ""
        elif event == "task.cancel_requested":
            self.state = "cancelling"
        elif event == "task.phase":
            self._runs(seen["phase"])
        elif event == "plugin.started":
            self.plugin = seen["plugin"]
        elif event == "task.progress":
            # Only a running plugin reports progress: this says so even when the stream opened after the
            # attempt's phase events went by (the task read then showed it leased: phases are written behind).
            self._runs("run")
            self.plugin = seen.get("plugin") or self.plugin
            self.fraction, self.message = seen["fraction"], seen.get("message", "")
        return self.render()

    def _runs(self, phase: str) -> None:
        """The attempt is in `phase`: running, unless a cancel was asked (that still stands)."""
        self.state, self.phase = ("cancelling" if self.state == "cancelling" else "running"), phase

    def render(self) -> Text:
        fraction = "" if self.fraction is None else f" {self.fraction * 100:5.1f}%"
        task_id, state, phase, plugin, message = map(visible, (self.task_id, self.state, self.phase, self.plugin,
                                                               self.message))  # before padding: columns align
        line = f"{task_id} {state:<10} {phase:<10} {plugin:<14}{fraction} {message}"
        return Text(line[:160], style=STYLE.get(self.state, ""))


SHOWN = ("id", "type", "organization", "state", "phase", "progress", "attempt", "priority", "node_id", "error",
         "payload", "required_tags", "idempotency_key", "created_at", "available_at", "updated_at", "finished_at")


def budget_marks(task: dict[str, Any]) -> list[str]:
    """For each attempt row, its place in the attempt budget as `list` writes it ("2/3"), or "-" for a row the
    budget does not count: an interruption by a shutdown, or a run before a retry by request began a new budget.
    The budget's attempts are the latest rows that are not interruptions."""
    left, marks = task["attempt"], []
    for row in reversed(task["attempts"]):
        counted = left > 0 and row["status"] != "interrupted"
        marks.append(f"{left}/{task['max_attempts']}" if counted else "-")
        left -= counted
    return marks[::-1]


def cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        task = await client.get(await resolve(client, args.task_id))
        if args.json:
            print_json(task)
            return OK
        console = stdout()
        facts = Table.grid(padding=(0, 2))
        for key in SHOWN:
            # .get: a daemon of an earlier version answers without the fields added since (organization)
            shown = f"{task['attempt']}/{task['max_attempts']}" if key == "attempt" else fact(key, task.get(key))
            facts.add_row(key, text(shown))
            if key == "id":  # the form list shows, which every command takes back
                facts.add_row("short_id", text((await short_forms(client, [task["id"]]))[task["id"]]))
        console.print(facts)
        attempts = Table("#", "budget", "status", "worker", "started (UTC)", "took", "error", title="attempts")
        for a, mark in zip(task["attempts"], budget_marks(task), strict=True):
            attempts.add_row(*map(text, (str(a["number"]), mark, a["status"], a["worker_id"], when(a["started_at"]),
                                         took(a["started_at"], a["finished_at"]), fact("error", a["error"]))))
        console.print(attempts)
        for r in task["results"]:
            console.print(text(f"result {result_line(r)}"))
        for name, sha256 in task.get("inputs", {}).items():  # .get: as for organization
            console.print(text(f"input {name} sha256 {sha256}"))
        if task.get("artifacts"):
            artifacts = artifact_rows(task["artifacts"])
            artifacts.title = "artifacts (tidepool fetch TASK NAME)"
            console.print(artifacts)
        return OK

    return with_client(args, settings, body)


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        page = await client.list(state=args.state, type=args.type, limit=args.limit, cursor=args.cursor,
                                 organization=args.organization)
        if args.json:
            print_json(page)
            return OK
        # On a narrow terminal the id, type and state stay whole; the other columns give way.
        rows = table(Column("id", no_wrap=True), Column("type", no_wrap=True),
                     Column("state", no_wrap=True), "phase", "progress", "attempt", "node", "created (UTC)")
        short = await short_forms(client, [t["id"] for t in page["tasks"]])
        for t in page["tasks"]:
            rows.add_row(text(short[t["id"]]), text(t["type"]), text(t["state"], STYLE.get(t["state"], "")),
                         *map(text, (t["phase"] or "", percent(t["progress"]), f"{t['attempt']}/{t['max_attempts']}",
                                     t["node_id"] or "", when(t["created_at"]))))
        stdout().print(rows)
        if page["next_cursor"]:  # on stderr: a pipe into grep or wc gets the rows alone; one line, never wrapped
            print(visible(f"more tasks: the next page is `tidepool list --cursor {page['next_cursor']}` with the "
                          "same --state, --type, --organization and --limit"), file=sys.stderr)
        return OK

    return with_client(args, settings, body)


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        print(visible(await client.cancel(await resolve(client, args.task_id))))
        return OK

    return with_client(args, settings, body)


def cmd_retry(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        print(visible(await client.retry(await resolve(client, args.task_id))))
        return OK

    return with_client(args, settings, body)


def add_commands(add: Any) -> None:
    p = add("submit", cmd_submit, "submit a task and print its id")
    p.add_argument("type")
    p.add_argument("--payload", default="{}", help="JSON, or @FILE")
    p.add_argument("--priority", type=int)
    p.add_argument("--max-attempts", type=int)
    p.add_argument("--key", help="idempotency key")
    p.add_argument("--tags", help="required resource tags, comma separated")
    p.add_argument("--organization", help="whose task it is (default: default)")
    add_input_option(p)
    p.add_argument("--wait", action="store_true", help="follow the task to its end; exit 1 unless completed")
    p = add("show", cmd_show, "show one task", json=True)
    p.add_argument("task_id", help="its id, or enough of its first digits to name one task")
    p = add("list", cmd_list, "list tasks, newest first", json=True)
    p.add_argument("--state")
    p.add_argument("--type")
    p.add_argument("--organization")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--cursor", help="the next page: the cursor a page before ended with")
    for name, func, help_text in (("cancel", cmd_cancel, "cancel a task"), ("retry", cmd_retry, "retry a task")):
        add(name, func, help_text).add_argument("task_id", help="its id, or enough of its first digits")
