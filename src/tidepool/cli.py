"""The `tidepool` command: parses arguments, loads settings once, runs one function per command."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from . import settings as settings_mod
from .client import ApiError, Client, Unreachable
from .errors import ConfigError, StoreUnavailable
from .settings import Settings

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
        print(f"tidepool: {exc}", file=sys.stderr)
        return USAGE
    except StoreUnavailable as exc:
        print(f"tidepool: {exc}", file=sys.stderr)
        return UNREACHABLE
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidepool", description="A worker-pool daemon for scanner hosts.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, help="config file (default: ./config/tidepool.toml, "
                                                    "then /etc/tidepool/tidepool.toml)")
    common.add_argument("--url", help="daemon API address (default: from api.listen)")
    sub = parser.add_subparsers(dest="command")

    def add(name: str, func: Callable[[argparse.Namespace, Settings], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help)
        p.set_defaults(func=func)
        return p

    add("run", cmd_run, "run the daemon in the foreground")
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
    for name, func, text in (("cancel", cmd_cancel, "cancel a task"), ("retry", cmd_retry, "retry a task")):
        add(name, func, text).add_argument("task_id")
    add("pool", cmd_pool, "workers, busy, queue depth, guards")
    add("schedules", cmd_schedules, "schedules with next/last run and last task state")
    p = add("config", cmd_config, "configuration tools")
    p.add_argument("action", choices=["check"])
    add("migrate", cmd_migrate, "create or upgrade the store schema")
    for p in sub.choices.values():
        if p.prog.split()[-1] in ("show", "list", "pool", "schedules"):
            p.add_argument("--json", action="store_true", help="print JSON for scripts")
    return parser


# the daemon


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    import anyio

    from . import logs
    from .service import serve
    from .systemd import Notifier

    logs.setup(settings.log.level, settings.log.format)
    faulthandler.enable()
    notifier = Notifier.from_environ(os.environ)
    config_path = settings_mod.find_config(args.config)
    try:
        anyio.run(lambda: serve(settings, config_path=config_path, notifier=notifier),
                  backend_options={"use_uvloop": _have_uvloop()})
    except ConfigError as exc:
        print(f"tidepool: {exc}", file=sys.stderr)
        return USAGE
    except StoreUnavailable as exc:
        print(f"tidepool: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tidepool: cannot start: {exc}", file=sys.stderr)
        return 1
    return OK


def _have_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from .store import open_store

    async def migrate() -> None:
        store = open_store(settings.store.url)
        await store.open(migrate=True)
        await store.close()

    asyncio.run(migrate())
    print(f"store {settings.store.url} is up to date")
    return OK


def cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    print(json.dumps(settings.model_dump(mode="json"), indent=2))
    return OK


# talking to the daemon


def _with_client(args: argparse.Namespace, settings: Settings,
                 body: Callable[[Client], Awaitable[int]]) -> int:
    url = args.url or _url(settings.api.listen)
    token = Path(settings.api.token_file).read_text().strip() if settings.api.token_file else None

    async def go() -> int:
        async with Client(url, token=token) as client:
            return await body(client)

    try:
        return asyncio.run(go())
    except Unreachable as exc:
        print(f"tidepool: {exc}", file=sys.stderr)
        return UNREACHABLE
    except ApiError as exc:
        print(f"tidepool: {exc.message} ({exc.status} {exc.code})", file=sys.stderr)
        return USAGE if exc.status in (400, 404, 409, 413, 415) else TASK_FAILED


def _url(listen: str) -> str:
    if listen.startswith("unix:"):
        return listen
    host, _, port = listen.rpartition(":")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    return f"http://{host}:{port}"


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    try:
        text = Path(args.payload[1:]).read_text() if args.payload.startswith("@") else args.payload
        payload = json.loads(text)
    except (OSError, ValueError) as exc:
        print(f"tidepool: --payload: {exc}", file=sys.stderr)
        return USAGE
    tags = [t for t in (args.tags or "").split(",") if t]

    async def body(client: Client) -> int:
        task = await client.submit(args.type, payload, priority=args.priority, max_attempts=args.max_attempts,
                                   idempotency_key=args.key, required_tags=tags or None)
        print(task["id"])
        if not args.wait:
            return OK
        final = await client.wait(task["id"], on_change=_progress_line)
        print(file=sys.stderr)
        print(f"{final['id']} {final['state']}" + (f": {final['error']['message']}" if final["error"] else ""),
              file=sys.stderr)
        return OK if final["state"] == "completed" else TASK_FAILED

    return _with_client(args, settings, body)


def _progress_line(task: dict[str, Any]) -> None:
    progress = task.get("progress") or {}
    fraction = f" {progress['fraction'] * 100:5.1f}%" if "fraction" in progress else ""
    message = f" {progress.get('message', '')}" if progress else ""
    line = f"{task['id']} {task['state']:<10} {task['phase'] or '':<10}{fraction}{message}"
    print(f"\r{line[:120]:<120}", end="", file=sys.stderr, flush=True)


def cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        task = await client.get(args.task_id)
        print(json.dumps(task, indent=2))
        return OK

    return _with_client(args, settings, body)


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        page = await client.list(state=args.state, type=args.type, limit=args.limit)
        if args.json:
            print(json.dumps(page, indent=2))
            return OK
        print(f"{'ID':<26}  {'TYPE':<12} {'STATE':<10} {'PHASE':<10} {'ATTEMPT':>7}  CREATED")
        for t in page["tasks"]:
            print(f"{t['id']:<26}  {t['type'][:12]:<12} {t['state']:<10} {t['phase'] or '-':<10} "
                  f"{t['attempt']:>3}/{t['max_attempts']:<3}  {t['created_at']}")
        return OK

    return _with_client(args, settings, body)


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        print(await client.cancel(args.task_id))
        return OK

    return _with_client(args, settings, body)


def cmd_retry(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        print(await client.retry(args.task_id))
        return OK

    return _with_client(args, settings, body)


def cmd_pool(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        pool = await client.pool()
        if args.json:
            print(json.dumps(pool, indent=2))
            return OK
        print(f"node     {pool['node_id']}{'  (draining)' if pool['draining'] else ''}")
        print(f"workers  {pool['workers']} (baseline {pool['baseline']}, demand {pool['demand']}), "
              f"busy {pool['busy']}, min {pool['min_workers']}, max {pool['max_workers']}")
        print("queue    " + ", ".join(f"{k} {v}" for k, v in pool["queue"].items()))
        print("guards   " + _guards_line(pool["guards"]))
        for name, r in pool.get("resources", {}).items():
            print(f"resource {name}: {r['in_use']}/{r['count']} in use, tags {', '.join(r['tags']) or '-'}")
        if pool["pending_restart"]:
            print(f"restart  needed for {', '.join(pool['pending_restart'])}")
        return OK

    return _with_client(args, settings, body)


def _guards_line(guards: dict[str, Any]) -> str:
    tripped = guards["tripped"]

    def figure(what: str) -> str:
        free = guards.get(f"free_{what}_mb")
        return f"{what} {'?' if free is None else free} MB free (floor {guards[f'min_free_{what}_mb']})"

    return f"{'tripped: ' + ', '.join(tripped) if tripped else 'ok'}; {figure('memory')}, {figure('disk')}"


def cmd_schedules(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        data = await client.request("GET", "/v1/schedules")
        if args.json:
            print(json.dumps(data, indent=2))
            return OK
        print(f"{'NAME':<20} {'TYPE':<12} {'WHEN':<16} {'NEXT RUN':<28} {'LAST RUN':<28} LAST TASK")
        for s in data["schedules"]:
            when = s["cron"] or f"every {s['every_s']:g}s"
            state = "paused" if s["paused"] else (s["next_run_at"] or "-")
            last = f"{s['last_task_id'] or '-'} {s['last_task_state'] or ''}".strip()
            last_run = s["last_run_at"] or "-"
            print(f"{s['name'][:20]:<20} {s['type'][:12]:<12} {when[:16]:<16} {state:<28} {last_run:<28} {last}")
        return OK

    return _with_client(args, settings, body)
