"""A node's start-up checks: what its settings must pass before it starts, checked by the calls a daemon
starts with, what they leave out, the daemon's own files kept private, and the store's schema brought up to
date (`tidepool migrate`)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from ..api import load_token
from ..errors import ConfigError
from ..execution.resources import ResourcePool
from ..gateway.tls import Credentials
from ..plugins import Registry
from ..plugins.command.confinement import RunAs, readable_by, run_as
from ..settings import BUILTIN_TYPES, Settings, redacted_url
from ..store import SCHEMA_VERSION, open_store

log = logging.getLogger("tidepool.service")  # the node's own lines, under the name they always had


def check_startable(settings: Settings) -> None:
    """What a daemon of these settings would refuse before it starts anything, by the calls it starts with
    (`tidepool config check`): the store URL, each type's plugins with allow/deny, the resource slots, the
    API's token. Nothing is opened, bound or connected; ConfigError names what is wrong."""
    open_store(settings.store.url, section=settings.store, artifacts=settings.artifacts,
               blob_dir=settings.node.state_dir / "blobs")
    plugin_registry(settings)
    ResourcePool.from_settings(settings.resources)
    load_token(settings.api.token_file, settings.api.listen)
    check_state_dir(settings.node.state_dir)
    if settings.gateway.listen:
        Credentials(settings.gateway)


async def migrate(settings: Settings) -> tuple[int, int]:
    """Create or upgrade the store's schema: the version it had (0: none) and the one it has now."""
    if settings.store.remote:
        raise ConfigError("config: store.url: a remote worker has no schema of its own; run tidepool migrate on "
                          "its gateway")
    store = open_store(settings.store.url)
    found = await store.open(migrate=True)
    await store.close()
    return found, SCHEMA_VERSION


def redacted(url: str) -> str:
    """The URL with its password, if any, as ***: for logs and messages."""
    return redacted_url(url)


def check_state_dir(state_dir: Path) -> None:
    """node.state_dir holds the SQLite file and the plugins' work directories: created when missing, but
    a file there would fail every command plugin's attempt, one retry after another."""
    if state_dir.exists() and not state_dir.is_dir():
        raise ConfigError(f"config: node.state_dir: {state_dir} is not a directory")


def keep_private(settings: Settings) -> None:
    """Before the daemon opens its store: node.state_dir 0700 (created so when missing) and the SQLite file
    0600 (created empty so, before SQLite makes it; its -wal and -shm files take its mode), so that no other
    user of the host, and no command run as one, reads them."""
    state_dir = settings.node.state_dir
    check_state_dir(state_dir)
    state_dir.mkdir(mode=stat.S_IRWXU, parents=True, exist_ok=True)
    _at_most(state_dir, stat.S_IRWXU)
    db = settings.db_path()
    if db is not None and db.parent.is_dir():
        if not db.exists():  # created private; an existing one (read-only on purpose, say) is left to the store
            os.close(os.open(db, os.O_CREAT | os.O_WRONLY, stat.S_IRUSR | stat.S_IWUSR))
        for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
            if path.exists():
                _at_most(path, stat.S_IRUSR | stat.S_IWUSR)


def _at_most(path: Path, mode: int) -> None:
    if stat.S_IMODE(path.stat().st_mode) & ~mode:
        try:
            path.chmod(mode)
        except OSError as exc:  # an immutable file: the store says what it can do with it
            log.warning("could not make %s private (mode %o): %s", path, mode, exc)


def check_secrets(settings: Settings) -> None:
    """No user a command runs as may read the API's token file or a private key of the node: ConfigError naming
    the key of the file that it could read."""
    users = command_users(settings)
    secrets = {"api.token_file": settings.api.token_file, "store.key_file": settings.store.key_file,
               "gateway.key_file": settings.gateway.key_file}
    for key, name in secrets.items():
        path = Path(name)
        if not name or not path.is_file():
            continue  # no such secret here, or its own check says what is wrong with it
        for user in users:
            if readable_by(path, user):
                raise ConfigError(f"config: {key}: {name} is readable by {user.name!r}, whom commands run as; "
                                  f"chmod 600 it (or 640, with a group that user is not in)")


def command_users(settings: Settings) -> list[RunAs]:
    """The users command plugins run as on this node (execution.command_user, and each one's `user`)."""
    named = {"execution.command_user": settings.execution.command_user}
    for name, spec in settings.plugins.defs.items():
        if spec.command is not None and spec.user and settings.plugins.permits(name):
            named[f"plugins.{name}.user"] = spec.user
    return [run_as(user, key=key) for key, user in named.items() if user]


def plugin_registry(settings: Settings) -> Registry:
    """The plugins of these settings, built as the daemon runs them (at start, at reload, at `config check`);
    the users commands run as are checked first, execution.command_user even on a node with no command."""
    check_secrets(settings)
    return Registry.from_settings(settings.plugins, settings.all_types, kill_grace_s=settings.execution.kill_grace_s,
                                  scope=settings.execution.scope, command_user=settings.execution.command_user,
                                  max_blob_bytes=settings.artifacts.max_blob_bytes)


def say_left_out(settings: Settings) -> None:
    """The built-in types plugins.allow/deny leave out: their tasks wait for a node that defines them."""
    left_out = sorted(set(BUILTIN_TYPES) - set(settings.all_types))
    if left_out:
        log.warning("built-in task types %s are not defined on this node: plugins.allow/deny leave out their "
                    "plugins", ", ".join(left_out))
