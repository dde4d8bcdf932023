"""Plugins: the registry that turns config into runnable steps, with allow/deny applied.

A plugin is `async def plugin(ctx: TaskContext) -> None`: a built-in, an entry point of the group
`tidepool.plugins`, a dotted path (`python = "pkg.mod:func"`) or a command from config.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from ..context import TaskContext
from ..errors import ConfigError, PluginError
from ..settings import PluginSpec, PluginsSettings, TypeSettings

Plugin = Callable[[TaskContext], Awaitable[None]]
ENTRY_POINT_GROUP = "tidepool.plugins"
RESERVED = frozenset({"allow", "deny"})


@dataclass(frozen=True)
class PluginDef:
    name: str
    run: Plugin
    timeout_s: float | None = None


class Registry:
    """Resolves task types to their plugins; built once per config (start and SIGHUP)."""

    def __init__(self, plugins: Mapping[str, PluginDef], types: Mapping[str, TypeSettings],
                 *, allow: tuple[str, ...] = ("*",), deny: tuple[str, ...] = ()) -> None:
        self._plugins = dict(plugins)
        self.types = dict(types)
        self.allow, self.deny = allow, deny
        self._allowed: dict[str, bool] = {}

    @classmethod
    def from_settings(cls, settings: PluginsSettings, types: Mapping[str, TypeSettings], *,
                      kill_grace_s: float) -> Registry:
        from .builtin import BUILTINS, command_plugin

        known: dict[str, PluginDef] = {name: PluginDef(name, fn) for name, fn in BUILTINS.items()}
        for name, spec in settings.defs.items():
            known[name] = _from_spec(name, spec, kill_grace_s=kill_grace_s,
                                     command_plugin=command_plugin)
        registry = cls(known, types, allow=settings.allow, deny=settings.deny)
        for type_name, type_settings in types.items():
            for plugin in type_settings.plugins:
                registry._check(type_name, plugin, load=True)
        return registry

    def allowed(self, plugin: str) -> bool:
        if plugin not in self._allowed:  # a registry lives as long as its config: cache the globs' verdict
            self._allowed[plugin] = any(fnmatchcase(plugin, g) for g in self.allow) and \
                not any(fnmatchcase(plugin, g) for g in self.deny)
        return self._allowed[plugin]

    def knows_type(self, type_name: str) -> bool:
        return type_name in self.types

    def plugins_for(self, type_name: str) -> list[PluginDef]:
        """The type's plugins in order; PluginError (not retried) when one is denied or unknown now."""
        settings = self.types.get(type_name)
        if settings is None:
            raise PluginError(f"unknown task type {type_name!r}", code="unknown_type", retryable=False)
        found = []
        for name in settings.plugins:
            if not self.allowed(name) or name not in self._plugins:
                raise PluginError(f"plugin {name!r} of type {type_name!r} is denied or unknown",
                                  code="plugin_denied", retryable=False)
            found.append(self._plugins[name])
        return found

    def _check(self, type_name: str, plugin: str, *, load: bool) -> None:
        if plugin not in self._plugins and load:
            entry = _entry_point(plugin)
            if entry is not None:
                self._plugins[plugin] = PluginDef(plugin, entry)
        if plugin not in self._plugins:
            raise ConfigError(f"config: types.{type_name}.plugins: unknown plugin {plugin!r}")
        if not self.allowed(plugin):
            raise ConfigError(f"config: types.{type_name}.plugins: plugin {plugin!r} is denied by "
                              "plugins.allow/plugins.deny")


def _from_spec(name: str, spec: PluginSpec, *, kill_grace_s: float,
               command_plugin: Callable[..., Plugin]) -> PluginDef:
    if name in RESERVED:
        raise ConfigError(f"config: plugins.{name}: {name!r} is a reserved name")
    if spec.python is not None:
        return PluginDef(name, load_dotted(spec.python, key=f"plugins.{name}.python"), spec.timeout_s)
    return PluginDef(name, command_plugin(name, spec, kill_grace_s=kill_grace_s), spec.timeout_s)


def load_dotted(path: str, *, key: str) -> Plugin:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"config: {key}: expected 'package.module:function', got {path!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"config: {key}: cannot load {path!r}: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"config: {key}: {path!r} is not callable")
    return fn  # type: ignore[no-any-return]


def _entry_point(name: str) -> Plugin | None:
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            return entry.load()  # type: ignore[no-any-return]
    return None
