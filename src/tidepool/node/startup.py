"""A node's start-up checks: what its settings must pass before it starts, checked by the calls a daemon
starts with, what they leave out, and the store's schema brought up to date (`tidepool migrate`)."""

from __future__ import annotations

import logging
from pathlib import Path

from ..api import load_token
from ..errors import ConfigError
from ..execution.resources import ResourcePool
from ..gateway.tls import Credentials
from ..plugins import Registry
from ..settings import BUILTIN_TYPES, Settings, redacted_url
from ..store import SCHEMA_VERSION, open_store

log = logging.getLogger("tidepool.service")  # the node's own lines, under the name they always had


def check_startable(settings: Settings) -> None:
    """What a daemon of these settings would refuse before it starts anything, by the calls it starts with
    (`tidepool config check`): the store URL, each type's plugins with allow/deny, the resource slots, the
    API's token. Nothing is opened, bound or connected; ConfigError names what is wrong."""
    open_store(settings.store.url, section=settings.store)
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


def plugin_registry(settings: Settings) -> Registry:
    return Registry.from_settings(settings.plugins, settings.all_types, kill_grace_s=settings.execution.kill_grace_s,
                                  scope=settings.execution.scope)


def say_left_out(settings: Settings) -> None:
    """The built-in types plugins.allow/deny leave out: their tasks wait for a node that defines them."""
    left_out = sorted(set(BUILTIN_TYPES) - set(settings.all_types))
    if left_out:
        log.warning("built-in task types %s are not defined on this node: plugins.allow/deny leave out their "
                    "plugins", ", ".join(left_out))
