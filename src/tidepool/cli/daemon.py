"""The commands that need no daemon: `run` (the daemon itself), `migrate` and `config check`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading

from .. import settings as settings_mod
from ..errors import ConfigError, SchemaMismatch, StoreUnavailable
from ..settings import Settings
from .output import OK, USAGE, fatal

EXIT_GRACE_S = 5.0  # from the end of the drain: see _exit_within


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    import anyio

    from .. import logs
    from ..node.daemon import serve
    from ..node.systemd import Notifier, enable_faulthandler

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
            fatal(f"tidepool: {leaf}")
            return USAGE
    for leaf in leaves:
        if isinstance(leaf, StoreUnavailable | SchemaMismatch):
            fatal(f"tidepool: {leaf}")
            return 1
        if isinstance(leaf, OSError):
            fatal(f"tidepool: cannot start: {str(leaf) or type(leaf).__name__}")
            return 1
    raise exc


def _have_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from ..node.startup import migrate, redacted

    found, current = asyncio.run(migrate(settings))
    where = f"store {redacted(settings.store.url)}"
    if found == current:
        print(f"{where}: the schema is current (version {current}); nothing to do")
    elif found == 0:
        print(f"{where}: created the schema (version {current})")
    else:
        print(f"{where}: upgraded the schema from version {found} to {current}")
    return OK


def cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    from ..node.startup import check_startable, redacted  # the daemon's modules: not loaded for the client commands

    check_startable(settings)
    effective = settings.model_dump(mode="json")
    effective["node"]["id"] = settings.node.node_id  # an empty id means the host name: say which
    effective["store"]["url"] = redacted(settings.store.url)  # printed, pasted into tickets: no password
    for plugin in effective["plugins"]["defs"].values():  # a plugin's env is where its API keys go
        plugin["env"] = dict.fromkeys(plugin["env"], "***")
    print(json.dumps(effective, indent=2))
    print(f"tidepool: {_read_from(args)}", file=sys.stderr)
    return OK


def _read_from(args: argparse.Namespace) -> str:
    """Which file `config check` read, of the places it looks; on stderr, so stdout stays the JSON alone."""
    found = settings_mod.find_config(args.config)
    if args.config is not None:
        return f"config read from {found} (--config), with the TIDEPOOL_* environment over it"
    if found is not None:
        return f"config read from {found}, with the TIDEPOOL_* environment over it"
    looked = " and ".join(map(str, settings_mod.DEFAULT_PATHS))
    return f"no config file found (looked for {looked}): defaults and the TIDEPOOL_* environment"
