"""Plugins: the registry that turns config into runnable steps, with allow/deny applied.

A plugin is `async def plugin(ctx: TaskContext) -> None`, using of ctx what PluginContext declares: a
built-in, an entry point of the group `tidepool.plugins`, a dotted path (`python = "pkg.mod:func"`) or a
command from config. Names are looked up in that order of precedence: config, built-ins, entry points.

`plugins.allow` / `plugins.deny` (names or globs) apply twice: at load, where a denied plugin is
never imported or built and a type naming it is a ConfigError, and at run time, before each plugin
of an attempt, where a denied one fails the task with `plugin_denied` (not retried).

There is deliberately no generic `command` plugin taking its argument list from the payload:
that would let anyone who can submit a task run any program. `command` is a name an operator
gives to a configured command plugin (`[plugins.command] command = [...]`); a type naming
`command` without that definition is a ConfigError that says so.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, PluginError
from ..settings import (
    ENTRY_POINT_GROUP,
    SCOPED_BUILTINS,
    ArtifactSettings,
    PluginSpec,
    PluginsSettings,
    TypeSettings,
    plugin_permitted,
)
from .context import PluginContext
from .scope import Scope, plugin_scope

Plugin = Callable[[PluginContext], Awaitable[None]]
RESERVED = frozenset({"allow", "deny"})
MAX_BLOB_BYTES: int = ArtifactSettings.model_fields["max_blob_bytes"].default  # a command's stdout at most


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
        self._type_tags = {name: frozenset(t.required_tags) for name, t in self.types.items()}
        self._allow, self._deny = tuple(allow), tuple(deny)
        self._allowed: dict[str, bool] = {}

    def set_policy(self, *, allow: tuple[str, ...] | None = None, deny: tuple[str, ...] | None = None) -> None:
        """New plugins.allow / plugins.deny globs (None keeps the current ones), in force from the next plugin
        an attempt runs."""
        self._allow = self._allow if allow is None else tuple(allow)
        self._deny = self._deny if deny is None else tuple(deny)
        self._allowed.clear()

    @classmethod
    def from_settings(cls, settings: PluginsSettings, types: Mapping[str, TypeSettings], *,
                      kill_grace_s: float, scope: tuple[str, ...] = (), command_user: str = "",
                      max_blob_bytes: int = MAX_BLOB_BYTES) -> Registry:
        """`scope`: execution.scope, the CIDRs of every plugin that names none of its own; `max_blob_bytes`:
        artifacts.max_blob_bytes, the most a command's stdout may be."""
        from .builtin import BUILTINS, command_plugin, scoped_builtin

        known: dict[str, PluginDef] = {name: PluginDef(name, fn) for name, fn in BUILTINS.items()}
        for name in SCOPED_BUILTINS:
            held_to = plugin_scope(name, settings.defs.get(name), scope)
            if held_to is not None:
                known[name] = PluginDef(name, scoped_builtin(name, held_to))
        registry = cls(known, types, allow=settings.allow, deny=settings.deny)
        for name, spec in settings.defs.items():
            if name in RESERVED:
                raise ConfigError(f"config: plugins.{name}: {name!r} is a reserved name")
            if spec.command is None and spec.python is None:
                continue  # a built-in prober's scope, bound above
            if registry.allowed(name):  # a denied plugin is never imported nor built
                registry._plugins[name] = _from_spec(name, spec, kill_grace_s=kill_grace_s,
                                                     command_user=command_user, command_plugin=command_plugin,
                                                     scope=plugin_scope(name, spec, scope),
                                                     max_blob_bytes=max_blob_bytes)
        for type_name, type_settings in types.items():
            for plugin in type_settings.plugins:
                registry._check(type_name, plugin, load=True)
        return registry

    def allowed(self, plugin: str) -> bool:
        if plugin not in self._allowed:  # a registry lives as long as its config: cache the globs' verdict
            self._allowed[plugin] = plugin_permitted(plugin, self._allow, self._deny)
        return self._allowed[plugin]

    def knows_type(self, type_name: str) -> bool:
        return type_name in self.types

    def required_tags(self, type_name: str) -> frozenset[str]:
        """The tags every task of this type needs on top of its own (`types.NAME.required_tags`)."""
        return self._type_tags.get(type_name, _NO_TAGS)

    def plugins_for(self, type_name: str) -> list[PluginDef]:
        """The type's plugins in order; PluginError (not retried) when one is denied or unknown now."""
        settings = self.types.get(type_name)
        if settings is None:
            raise PluginError(f"unknown task type {type_name!r}", code="unknown_type", retryable=False)
        found = []
        for name in settings.plugins:
            if not self.allowed(name):
                raise denied(name, type_name)
            if name not in self._plugins:
                raise PluginError(f"plugin {name!r} of type {type_name!r} is not loaded on this node",
                                  code="unknown_plugin", retryable=False)
            found.append(self._plugins[name])
        return found

    def _check(self, type_name: str, plugin: str, *, load: bool) -> None:
        where = f"config: types.{type_name}.plugins"
        if not self.allowed(plugin):  # checked first: a denied entry point is not even imported
            raise ConfigError(f"{where}: plugin {plugin!r} is denied by plugins.allow/plugins.deny")
        if plugin not in self._plugins and load:
            entry = _entry_point(plugin, where=where)
            if entry is not None:
                self._plugins[plugin] = PluginDef(plugin, entry)
        if plugin == "command" and plugin not in self._plugins:
            raise ConfigError(f"{where}: plugin 'command' runs only a configured argument list; define "
                              "[plugins.command] command = [\"program\", \"{field}\", ...] to use it")
        if plugin not in self._plugins:
            raise ConfigError(f"{where}: unknown plugin {plugin!r} (not built in, not in [plugins], "
                              f"no entry point in group {ENTRY_POINT_GROUP!r})")


_NO_TAGS: frozenset[str] = frozenset()


def denied(plugin: str, type_name: str) -> PluginError:
    return PluginError(f"plugin {plugin!r} of type {type_name!r} is denied by plugins.allow/plugins.deny",
                       code="plugin_denied", retryable=False)


def _from_spec(name: str, spec: PluginSpec, *, kill_grace_s: float, command_user: str,
               command_plugin: Callable[..., Plugin], scope: Scope | None, max_blob_bytes: int) -> PluginDef:
    if spec.python is not None:
        run = load_dotted(spec.python, key=f"plugins.{name}.python")
        return PluginDef(name, run if scope is None else _held_to(scope, run), spec.timeout_s)
    return PluginDef(name, command_plugin(name, spec, kill_grace_s=kill_grace_s, command_user=command_user,
                                          scope=scope, max_blob_bytes=max_blob_bytes), spec.timeout_s)


def _held_to(scope: Scope, run: Plugin) -> Plugin:
    """A Python plugin that starts only once the targets its payload names are found inside `scope`."""

    async def checked(ctx: PluginContext) -> None:
        await scope.check_payload(ctx.payload)
        await run(ctx)

    checked.__name__ = getattr(run, "__name__", "plugin")
    return checked


def load_dotted(path: str, *, key: str) -> Plugin:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"config: {key}: expected 'package.module:function', got {path!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (Exception, SystemExit) as exc:  # importing runs the module's code: a failure, or its sys.exit(),
        # is a config problem here (not `config check` passing, or the daemon ending, silently with 0)
        raise ConfigError(f"config: {key}: cannot load {path!r}: {type(exc).__name__}: {exc}") from None
    return _coroutine_function(fn, f"config: {key}: {path!r}")


def _coroutine_function(fn: Any, what: str) -> Plugin:
    """`fn` if it is an async function (or wraps one, with functools.wraps, or is a callable whose __call__
    is one); else a config error, now, rather than a TypeError and a failed attempt for every task of its
    type."""
    if not callable(fn):
        raise ConfigError(f"{what} is not callable")
    if not any(inspect.iscoroutinefunction(f) for f in (fn, inspect.unwrap(fn), type(fn).__call__)):
        raise ConfigError(f"{what} is not an async function: a plugin is `async def plugin(ctx)`")
    return fn  # type: ignore[no-any-return]


def _entry_point(name: str, *, where: str) -> Plugin | None:
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            try:
                fn = entry.load()
            except (Exception, SystemExit) as exc:  # an entry point's import runs foreign code: say whose
                raise ConfigError(f"{where}: cannot load entry point {name!r} ({entry.value}): "
                                  f"{type(exc).__name__}: {exc}") from None
            return _coroutine_function(fn, f"{where}: entry point {name!r} ({entry.value})")
    return None
