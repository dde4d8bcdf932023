"""The reload's reading of a changed config: the keys a SIGHUP changed, and those that only a restart
applies (the daemon tells each part its new sections; see Daemon.reload)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..settings import Section, Settings

RESTART_KEYS = ("store.url", "api.listen", "node.id", "node.state_dir", "node.heartbeat_s", "api.token_file",
                "api.max_body_kb", "gateway.listen")
POOL_SIZES = ("pool.min_workers", "pool.max_workers", "pool.idle_timeout_s")


def changed_keys(old: Settings, new: Settings) -> list[str]:
    """`section.key` for every key of a section that differs; a whole table (types, resources) by name."""
    changed = []
    for name in type(old).model_fields:
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        if isinstance(before, Section):
            changed += [f"{name}.{key}" for key in type(before).model_fields
                        if getattr(before, key) != getattr(after, key)]
        else:
            changed.append(name)
    return changed


def needs_restart(boot: Settings, new: Settings) -> list[str]:
    """What differs from the settings the node started with (a key changed and changed back needs no restart)
    and only a restart applies: the store, the API's address and token, the node's identity, and its slots
    (they may be in use: the slot pool is built once)."""
    keys = [k for k in RESTART_KEYS if _get(new, k) != _get(boot, k)]
    return keys + (["resources"] if new.resources != boot.resources else [])


def rejection(exc: Exception) -> str:
    """Why a new config was refused, on one line: a ConfigError says it all; anything else (a plugin module
    may raise anything on import) is named by its class."""
    return " ".join(str(exc).split("\n")) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"


def _get(settings: Settings, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(settings, section), key)
