"""Scan profiles in the config: `[profiles.NAME] steps = [...]`, the types each step runs, and their checks.

A step names a task type, or else a plugin: a plugin's name is a type of that one plugin, defined on the
node for as long as a profile names it (`steps = ["tcp_connect", "http_probe"]` needs no `[types]`).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping

from pydantic import Field, field_validator

from ..errors import ConfigError
from .sections import BUILTIN_PLUGINS, BUILTIN_TYPES, ENTRY_POINT_GROUP, PluginsSettings, Section, TypeSettings


class ProfileSettings(Section):
    # A profile of no step would succeed every scan unrun.
    steps: tuple[str, ...] = Field(min_length=1, description="The scan's steps, run in order, each its own "
                                   "task: a task type, or a plugin's name (a type of that one plugin).")
    continue_on_failure: bool = Field(False, description="True: a failed step is recorded and the next one "
                                      "runs; false: it ends the scan failed, the steps after it skipped.")

    @field_validator("steps", mode="before")
    @classmethod
    def _some_step(cls, steps: object) -> object:
        if isinstance(steps, list | tuple) and not steps:
            raise ValueError("a profile needs at least one step: a task type or a plugin name")
        return steps


# Built in so that a fresh node can run a scan: the ports open among payload.ports, then an HTTP(S) probe of
# each (tcp_connect puts them in the scope as open_ports, which the next step's payload carries).
# The words `tidepool scan` takes as a scan's verbs (`tidepool scan show ID`): never a profile's name.
SCAN_VERBS = ("show", "cancel", "retry")
BUILTIN_PROFILES: dict[str, ProfileSettings] = {
    "discover": ProfileSettings(steps=("tcp_connect", "http_probe")),
}


def step_types(profiles: Mapping[str, ProfileSettings], types: Mapping[str, TypeSettings]) -> dict[str, TypeSettings]:
    """The one-plugin types the profiles' steps imply: each step that names no type in `types`."""
    return {step: TypeSettings(plugins=(step,)) for profile in profiles.values() for step in profile.steps
            if step not in types}


def usable_builtins(plugins: PluginsSettings) -> dict[str, ProfileSettings]:
    """The built-in profiles whose every step plugins.allow and plugins.deny let run (as for built-in types)."""
    return {name: profile for name, profile in BUILTIN_PROFILES.items()
            if all(plugins.permits(p) for step in profile.steps for p in _plugins_of(step))}


def _plugins_of(step: str) -> tuple[str, ...]:
    builtin = BUILTIN_TYPES.get(step)
    return (step,) if builtin is None else builtin.plugins


def check_profiles(profiles: Mapping[str, ProfileSettings], types: Mapping[str, TypeSettings],
                   plugins: PluginsSettings) -> None:
    """ConfigError naming the step (`profiles.web.steps[1]`) that names neither a type nor a plugin, or a
    plugin plugins.allow/deny refuse. `types`: the config's own and the built-in ones (a built-in type left
    out by allow/deny is told as such)."""
    known_plugins: set[str] | None = None
    for name, profile in profiles.items():
        if name in SCAN_VERBS:
            raise ConfigError(f"config: profiles.{name}: {name!r} is a verb of `tidepool scan` "
                              f"({', '.join(SCAN_VERBS)}); name the profile otherwise")
        for index, step in enumerate(profile.steps):
            where = f"config: profiles.{name}.steps[{index}]"
            own = types.get(step) or BUILTIN_TYPES.get(step)
            if own is not None:
                if denied := [p for p in own.plugins if not plugins.permits(p)]:
                    raise ConfigError(f"{where}: type {step!r} runs plugin {denied[0]!r}, which plugins.allow/"
                                      "plugins.deny refuse")
                continue
            if not plugins.permits(step):
                raise ConfigError(f"{where}: plugin {step!r} is denied by plugins.allow/plugins.deny")
            known_plugins = _plugin_names(plugins) if known_plugins is None else known_plugins
            if step not in known_plugins:
                raise ConfigError(f"{where}: {step!r} is neither a task type nor a plugin (not built in, not in "
                                  f"[types] or [plugins], no entry point in group {ENTRY_POINT_GROUP!r})")


def _plugin_names(plugins: PluginsSettings) -> set[str]:
    """Every plugin name the registry could load: built in, configured, or an entry point (named, not loaded)."""
    entry_points = {entry.name for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return set(BUILTIN_PLUGINS) | set(plugins.defs) | entry_points
