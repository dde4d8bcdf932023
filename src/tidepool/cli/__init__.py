"""The `tidepool` command: parses arguments, loads settings once, runs one function per command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .. import settings as settings_mod
from ..errors import ConfigError, SchemaMismatch, StoreUnavailable
from ..settings import Settings
from . import events, files, fleet, pki, scans, schedules, tasks, workers
from .daemon import EXIT_GRACE_S, cmd_config, cmd_migrate, cmd_run
from .output import OK, TASK_FAILED, UNREACHABLE, USAGE, fatal
from .talk import add_client_options, exit_code

__all__ = ["EXIT_GRACE_S", "OK", "TASK_FAILED", "UNREACHABLE", "USAGE", "exit_code", "main"]

Command = Callable[[argparse.Namespace, Settings], int]
# A schema mismatch is exit 1, not 3: the store answered, and trying again will not help.
FAILED_WITH = ((ConfigError, USAGE), (StoreUnavailable, UNREACHABLE), (SchemaMismatch, 1))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(scans.verb_first(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help(sys.stderr)
        return USAGE
    try:
        settings = settings_mod.load(args.config)
        command: Command = args.func
        return command(args, settings)
    except (ConfigError, StoreUnavailable, SchemaMismatch) as exc:
        fatal(f"tidepool: {exc}")
        return next(code for kind, code in FAILED_WITH if isinstance(exc, kind))
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
    add_client_options(client)
    sub = parser.add_subparsers(dest="command")

    def add(name: str, func: Command, help: str, *, common: argparse.ArgumentParser = client,
            json: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help)
        p.set_defaults(func=func)
        if json:
            p.add_argument("--json", action="store_true", help="print JSON for scripts")
        return p

    add("run", cmd_run, "run the daemon in the foreground", common=local)
    tasks.add_commands(add)
    files.add_commands(add)
    fleet.add_commands(add)
    schedules.add_commands(add)
    scans.add_commands(add)
    workers.add_commands(add)
    events.add_commands(add)
    pki.add_commands(add)
    p = add("config", cmd_config, "configuration tools", common=local)
    p.add_argument("action", choices=["check"])
    add("migrate", cmd_migrate, "create or upgrade the store schema (the store.url of --config and the environment)",
        common=local)
    return parser
