"""The `tidepool` command: parses arguments, loads settings once, runs one function per command."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Column, Table
from rich.text import Text

from . import settings as settings_mod
from .client import ApiError, Client, InvalidAddress, Unreachable
from .errors import ConfigError, SchemaMismatch, StoreUnavailable
from .settings import Settings, api_address, read_token

OK, TASK_FAILED, USAGE, UNREACHABLE = 0, 1, 2, 3


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return USAGE
    try:
        settings = settings_mod.load(args.config)
        command: Callable[[argparse.Namespace, Settings], int] = args.func
        return command(args, settings)
    except ConfigError as exc:
        _fatal(f"tidepool: {exc}")
        return USAGE
    except StoreUnavailable as exc:
        _fatal(f"tidepool: {exc}")
        return UNREACHABLE
    except SchemaMismatch as exc:  # the store answered: not exit 3, and retrying will not help
        _fatal(f"tidepool: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `tidepool list | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidepool", description="A worker-pool daemon for scanner hosts.")
    local = argparse.ArgumentParser(add_help=False)  # commands that read the config only: run, config, migrate
    local.add_argument("--config", type=Path, help="config file (default: ./config/tidepool.toml, "
                                                   "then /etc/tidepool/tidepool.toml)")
    client = argparse.ArgumentParser(add_help=False, parents=[local])  # commands that talk to the daemon
    client.add_argument("--url", help="daemon API address (default: from api.listen)")
    sub = parser.add_subparsers(dest="command")

    def add(name: str, func: Callable[[argparse.Namespace, Settings], int], help: str, *,
            common: argparse.ArgumentParser = client) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help)
        p.set_defaults(func=func)
        return p

    add("run", cmd_run, "run the daemon in the foreground", common=local)
    p = add("submit", cmd_submit, "submit a task and print its id")
    p.add_argument("type")
    p.add_argument("--payload", default="{}", help="JSON, or @FILE")
    p.add_argument("--priority", type=int)
    p.add_argument("--max-attempts", type=int)
    p.add_argument("--key", help="idempotency key")
    p.add_argument("--tags", help="required resource tags, comma separated")
    p.add_argument("--wait", action="store_true", help="follow the task to its end; exit 1 unless completed")
    p = add("show", cmd_show, "show one task")
    p.add_argument("task_id")
    p = add("list", cmd_list, "list tasks, newest first")
    p.add_argument("--state")
    p.add_argument("--type")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--cursor", help="the next page: the cursor a page before ended with")
    for name, func, text in (("cancel", cmd_cancel, "cancel a task"), ("retry", cmd_retry, "retry a task")):
        add(name, func, text).add_argument("task_id")
    add("pool", cmd_pool, "workers, busy, queue depth, guards")
    add("nodes", cmd_nodes, "nodes sharing the store, with liveness")
    add("schedules", cmd_schedules, "schedules with next/last run and last task state")
    p = add("config", cmd_config, "configuration tools", common=local)
    p.add_argument("action", choices=["check"])
    add("migrate", cmd_migrate, "create or upgrade the store schema (the store.url of --config and the environment)",
        common=local)
    for p in sub.choices.values():
        if p.prog.split()[-1] in ("show", "list", "pool", "nodes", "schedules"):
            p.add_argument("--json", action="store_true", help="print JSON for scripts")
    return parser


# the daemon


EXIT_GRACE_S = 5.0  # from the end of the drain: see _exit_within


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    import anyio

    from . import logs
    from .service import serve
    from .systemd import Notifier, enable_faulthandler

    logs.setup(settings.log.level, settings.log.format)
    # Until the daemon listens for it (the store opened, the API bound), a SIGHUP must not end the process
    # as its default action does. The daemon's own handler replaces this one, so commands do not inherit it.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    enable_faulthandler()  # a watchdog abort (SIGABRT) leaves every thread's traceback in the journal
    notifier = Notifier.from_environ(os.environ)
    config_path = settings_mod.find_config(args.config)
    try:
        anyio.run(lambda: serve(settings, config_path=config_path, notifier=notifier,
                                when_drained=lambda: _exit_within(EXIT_GRACE_S)),
                  backend_options={"use_uvloop": _have_uvloop()})
    except Exception as exc:  # sorted into exit codes below; the unexpected is re-raised
        return _run_failed(exc)
    return OK


def _exit_within(grace_s: float) -> None:
    """Shutdown has written every outcome: end the process within grace_s even if plugin code still runs.

    A plugin blocked in a thread (asyncio.to_thread cannot be cancelled) or one that swallows its
    cancellation would keep the process alive for as long as it pleases, past systemd's TimeoutStopSec
    and its SIGKILL. Its attempt is already recorded, so nothing is lost by leaving without it."""

    def end() -> None:
        logging.getLogger("tidepool.service").error(
            "the process has not ended %.0fs after the drain (plugin code blocked in a thread, a plugin that "
            "ignores its cancellation, or a store call that does not return); exiting without it", grace_s)
        logging.shutdown()
        os._exit(OK)

    timer = threading.Timer(grace_s, end)
    timer.daemon = True  # a process that ends on its own first takes it along
    timer.start()


def _run_failed(exc: Exception) -> int:
    """One line on stderr and the exit code for what stopped the daemon; anything unexpected is re-raised.
    What a part raised inside the daemon's task group arrives wrapped in an ExceptionGroup."""
    leaves = [exc]
    while len(leaves) == 1 and isinstance(leaves[0], BaseExceptionGroup):
        leaves = list(leaves[0].exceptions)  # type: ignore[arg-type]
    for leaf in leaves:
        if isinstance(leaf, ConfigError):
            _fatal(f"tidepool: {leaf}")
            return USAGE
    for leaf in leaves:
        if isinstance(leaf, StoreUnavailable | SchemaMismatch):
            _fatal(f"tidepool: {leaf}")
            return 1
        if isinstance(leaf, OSError):
            _fatal(f"tidepool: cannot start: {str(leaf) or type(leaf).__name__}")
            return 1
    raise exc


def _fatal(message: str) -> None:
    """Why a command (the daemon among them) could not go on; in the journal at error priority, so
    `journalctl -p warning` shows it."""
    from . import logs

    print(f"<3>{message}" if logs.stderr_is_journal() else message, file=sys.stderr)


def _have_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from .service import redacted
    from .store import SCHEMA_VERSION, open_store

    async def migrate() -> int:
        store = open_store(settings.store.url)
        found = await store.open(migrate=True)
        await store.close()
        return found

    found, current = asyncio.run(migrate()), SCHEMA_VERSION
    where = f"store {redacted(settings.store.url)}"
    if found == current:
        print(f"{where}: the schema is current (version {current}); nothing to do")
    elif found == 0:
        print(f"{where}: created the schema (version {current})")
    else:
        print(f"{where}: upgraded the schema from version {found} to {current}")
    return OK


def cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    from .service import check_startable, redacted  # the daemon's modules: not loaded for the client commands

    check_startable(settings)
    effective = settings.model_dump(mode="json")
    effective["node"]["id"] = settings.node.node_id  # an empty id means the host name: say which
    effective["store"]["url"] = redacted(settings.store.url)  # printed, pasted into tickets: no password
    print(json.dumps(effective, indent=2))
    return OK


# talking to the daemon


def _with_client(args: argparse.Namespace, settings: Settings,
                 body: Callable[[Client], Awaitable[int]]) -> int:
    url = args.url or _url(settings.api.listen)
    token = read_token(settings.api.token_file)

    async def go() -> int:
        async with Client(url, token=token) as client:
            return await body(client)

    try:
        return asyncio.run(go())
    except InvalidAddress as exc:
        print(_visible(f"tidepool: {'--url' if args.url else 'api.listen'}: {exc}"), file=sys.stderr)
        return USAGE
    except Unreachable as exc:
        print(_visible(f"tidepool: {exc}"), file=sys.stderr)
        return UNREACHABLE
    except ApiError as exc:  # the daemon's message often quotes the request back: an id, a type name
        print(_visible(f"tidepool: {exc.message} ({exc.status} {exc.code})"), file=sys.stderr)
        return exit_code(exc.status)


def exit_code(status: int) -> int:
    """The exit code for an HTTP error answer. 1 is kept for a task that ended badly: a refusal is the
    request's or the token's (2); a daemon that answers but cannot take it now (store down, queue full,
    the body too slow to arrive), or fails, is as good as unreachable (3)."""
    return USAGE if 400 <= status < 500 and status not in (408, 429) else UNREACHABLE


def _url(listen: str) -> str:
    """Where this host reaches the daemon that binds `listen`: a wildcard address by its loopback."""
    address = api_address(listen)
    if isinstance(address, str):
        return listen
    host, port = address
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    try:
        text = Path(args.payload[1:]).read_text() if args.payload.startswith("@") else args.payload
        payload = json.loads(text)
    except (OSError, ValueError) as exc:
        print(f"tidepool: --payload: {exc}", file=sys.stderr)
        return USAGE
    tags = [t.strip() for t in (args.tags or "").split(",") if t.strip()]

    async def body(client: Client) -> int:
        task = await client.submit(args.type, payload, priority=args.priority, max_attempts=args.max_attempts,
                                   idempotency_key=args.key, required_tags=tags or None)
        print(_visible(task["id"]))
        if not args.wait:
            return OK
        progress = _Progress(task["id"])
        with Live(progress.render(), console=_ERR, transient=True, refresh_per_second=8) as live:
            final = await client.wait(task["id"], on_change=lambda seen: live.update(progress.see(seen)))
        error = f": {final['error']['message']}" if final["error"] else ""
        _ERR.print(Text.assemble(_text(f"{final['id']} "), _text(final["state"], _STYLE.get(final["state"], "")),
                                 _text(error)))
        return OK if final["state"] == "completed" else TASK_FAILED

    return _with_client(args, settings, body)


_ERR = Console(stderr=True)
_STYLE = {"completed": "green", "failed": "red", "timed_out": "red", "cancelled": "yellow", "running": "cyan"}
_VISIBLE = {c: f"\\u{c:04x}" for c in (*range(0x20), *range(0x7f, 0xa0))}  # C0, DEL and C1


def _stdout() -> Console:
    """Tables fit a terminal's width; piped into grep or a file, no column is cut at rich's default 80."""
    return Console(width=None if sys.stdout.isatty() else 10_000)


def _visible(text: str) -> str:
    """Text from a task or the daemon with every control character spelled out as JSON spells it (ESC as
    \\u001b), so that no error message or payload can clear the screen, set the window title or overwrite
    a line. Backslashes stay as they are: a literal "\\u001b" in the data looks the same, and is as harmless."""
    return text.translate(_VISIBLE)


def _text(value: str, style: str = "") -> Text:
    """Data for a rich renderable: control characters made visible, and never read as markup or emoji."""
    return Text(_visible(value), style=style)


class _Progress:
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
        task_id, state, phase, plugin, message = map(_visible, (self.task_id, self.state, self.phase, self.plugin,
                                                                self.message))  # before padding: columns align
        line = f"{task_id} {state:<10} {phase:<10} {plugin:<14}{fraction} {message}"
        return Text(line[:160], style=_STYLE.get(self.state, ""))


def cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        task = await client.get(args.task_id)
        if args.json:
            print(json.dumps(task, indent=2))  # ensure_ascii: every control character leaves as \u00XX
            return OK
        console = _stdout()
        facts = Table.grid(padding=(0, 2))
        for key in ("id", "type", "state", "phase", "progress", "attempt", "max_attempts", "priority", "node_id",
                    "error", "payload", "required_tags", "idempotency_key", "created_at", "available_at",
                    "updated_at", "finished_at"):
            facts.add_row(key, _text(_fact(key, task[key])))
        console.print(facts)
        attempts = Table("#", "status", "worker", "started (UTC)", "took", "error", title="attempts")
        for a in task["attempts"]:
            attempts.add_row(*map(_text, (str(a["number"]), a["status"], a["worker_id"], _when(a["started_at"]),
                                          _took(a["started_at"], a["finished_at"]), _fact("error", a["error"]))))
        console.print(attempts)
        for r in task["results"]:
            console.print(_text(f"result {r['plugin']}#{r['sequence']}{' (final)' if r['final'] else ''}: "
                                f"{json.dumps(r['payload'])[:2000]}"))
        return OK

    return _with_client(args, settings, body)


def _fact(key: str, value: Any) -> str:
    """One field of a task as a person reads it: "-" for none, progress and errors as sentences."""
    if value is None or value == []:
        return "-"
    if key == "progress":
        return " ".join(p for p in (_percent(value), value.get("message", "")) if p) or "-"
    if key == "error":  # a command's stderr often ends its message with a newline: not worth a \u000a
        return f"{value.get('code')}: {str(value.get('message')).rstrip()}"
    if key == "required_tags":
        return ", ".join(value)
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def _table(*columns: Column | str) -> Table:
    """A listing: a rule under the header, one space between columns."""
    return Table(*columns, box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, show_edge=False)


def _when(ts: str | None) -> str:
    """An RFC 3339 UTC time to the second, as tables show it (the JSON keeps the microseconds)."""
    return "-" if ts is None else ts[:19].replace("T", " ")


def _percent(progress: dict[str, Any] | None) -> str:
    return f"{progress['fraction'] * 100:.0f}%" if progress and "fraction" in progress else ""


def _took(started: str, finished: str | None) -> str:
    if finished is None:
        return "-"
    seconds = (datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds()
    return f"{seconds:.2f}s"


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        page = await client.list(state=args.state, type=args.type, limit=args.limit, cursor=args.cursor)
        if args.json:
            print(json.dumps(page, indent=2))
            return OK
        # On a narrow terminal the id, type and state stay whole; the other columns give way.
        table = _table(Column("id", no_wrap=True, min_width=32), Column("type", no_wrap=True),
                       Column("state", no_wrap=True), "phase", "progress", "attempt", "node", "created (UTC)")
        for t in page["tasks"]:
            table.add_row(_text(t["id"]), _text(t["type"]), _text(t["state"], _STYLE.get(t["state"], "")),
                          *map(_text, (t["phase"] or "", _percent(t["progress"]), f"{t['attempt']}/{t['max_attempts']}",
                                       t["node_id"] or "", _when(t["created_at"]))))
        _stdout().print(table)
        if page["next_cursor"]:  # on stderr: a pipe into grep or wc gets the rows alone; one line, never wrapped
            print(_visible(f"more tasks: the next page is `tidepool list --cursor {page['next_cursor']}` with the "
                           "same --state, --type and --limit"), file=sys.stderr)
        return OK

    return _with_client(args, settings, body)


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        print(_visible(await client.cancel(args.task_id)))
        return OK

    return _with_client(args, settings, body)


def cmd_retry(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        print(_visible(await client.retry(args.task_id)))
        return OK

    return _with_client(args, settings, body)


def cmd_pool(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        pool = await client.pool()
        if args.json:
            print(json.dumps(pool, indent=2))
            return OK
        lines = [f"node     {pool['node_id']}{'  (draining)' if pool['draining'] else ''}",
                 f"workers  {pool['workers']} (baseline {pool['baseline']}, demand {pool['demand']}), "
                 f"busy {pool['busy']}, min {pool['min_workers']}, max {pool['max_workers']}",
                 "queue    " + ", ".join(f"{k} {v}" for k, v in pool["queue"].items()),
                 "guards   " + _guards_line(pool["guards"])]
        for name, r in pool.get("resources", {}).items():
            lines.append(f"resource {name}: {r['in_use']}/{r['count']} in use, tags {', '.join(r['tags']) or '-'}")
        if pool["pending_restart"]:
            lines.append(f"restart  needed for {', '.join(pool['pending_restart'])}")
        for line in lines:
            print(_visible(line))
        return OK

    return _with_client(args, settings, body)


def _guards_line(guards: dict[str, Any]) -> str:
    tripped = guards["tripped"]

    def figure(what: str) -> str:
        free = guards.get(f"free_{what}_mb")
        return f"{what} {'?' if free is None else free} MB free (floor {guards[f'min_free_{what}_mb']})"

    return f"{'tripped: ' + ', '.join(tripped) if tripped else 'ok'}; {figure('memory')}, {figure('disk')}"


def cmd_nodes(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        data = await client.request("GET", "/v1/nodes")
        if args.json:
            print(json.dumps(data, indent=2))
            return OK
        table = _table(Column("node", no_wrap=True), "alive", "host", "pid", "version", "started (UTC)",
                       "heartbeat (UTC)", "types", "tags", "max")
        for n in data["nodes"]:
            alive = Text("yes", style="green") if n["alive"] else Text("stopped" if n["stopped_at"] else "no",
                                                                      style="red")
            tags = "; ".join(",".join(t) for t in n["tags"]) or "-"
            table.add_row(_text(n["node_id"]), alive,
                          *map(_text, (n["hostname"], str(n["pid"]), n["version"], _when(n["started_at"]),
                                       _when(n["heartbeat_at"]), ",".join(n["task_types"]), tags,
                                       str(n["max_workers"]))))
        _stdout().print(table)
        return OK

    return _with_client(args, settings, body)


def cmd_schedules(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        data = await client.request("GET", "/v1/schedules")
        if args.json:
            print(json.dumps(data, indent=2))
            return OK
        table = _table(Column("name", no_wrap=True), "type", "when", "next run (UTC)", "last run (UTC)", "last task")
        for s in data["schedules"]:
            when = s["cron"] or f"every {s['every_s']:g}s"
            next_run = "paused" if s["paused"] else _when(s["next_run_at"])
            last = f"{s['last_task_id'] or '-'} {s['last_task_state'] or ''}".strip()
            table.add_row(*map(_text, (s["name"], s["type"], when, next_run, _when(s["last_run_at"]), last)))
        _stdout().print(table)
        return OK

    return _with_client(args, settings, body)
