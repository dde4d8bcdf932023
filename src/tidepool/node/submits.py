"""The payload checks of a submit, before anything is queued: against the command templates its task type
will fill in (PayloadCheck), and against the scopes of its plugins (ScopeCheck).

The same checks run again when the attempt starts (a command plugin's own rendering, its scope right before
the command); doing them at submit makes a payload that no attempt could run a 400 naming the field, instead
of a task that fails later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from yarl import URL

from ..errors import InvalidArgument, InvalidRequest, OutOfScope, TargetRefused
from ..plugins.command import render_argv
from ..plugins.command.template import input_names
from ..plugins.scope import Resolved, Scope, plugin_scope
from ..settings import Settings

# What the node fills in for every attempt: their values are the node's, never the payload's to get wrong.
STAND_INS = {"task_id": "0" * 32, "attempt": 1, "workdir": "/work"}


class PayloadCheck:
    """The command templates of each task type, gathered once per config: a submit of a type without
    commands (most of them) costs one dict look-up."""

    def __init__(self, settings: Settings) -> None:
        self._commands: dict[str, list[tuple[str, tuple[str, ...], dict[str, str]]]] = {}
        for task_type, task_settings in settings.all_types.items():
            specs = [(plugin, settings.plugins.defs.get(plugin)) for plugin in task_settings.plugins]
            commands = [(plugin, spec.command, _input_stand_ins(spec.command)) for plugin, spec in specs
                        if spec and spec.command is not None]
            if commands:
                self._commands[task_type] = commands

    def __call__(self, task_type: str, payload: Mapping[str, Any]) -> None:
        """InvalidRequest naming the payload field a command plugin of `task_type` could not put in its
        arguments: a placeholder with no value, a value starting with "-", one that is not a string or number."""
        for plugin, command, inputs in self._commands.get(task_type, ()):
            try:
                render_argv(command, {**payload, **STAND_INS, **inputs})
            except InvalidArgument as exc:
                raise InvalidRequest(exc.field, f"{str(exc).split(': ', 1)[1]} (plugin {plugin}'s command)") from None


def _input_stand_ins(command: tuple[str, ...]) -> dict[str, str]:
    """A path for each `{input:NAME}`: a scan's step gets inputs from the steps before it, which no submit
    knows yet, so an input is checked only when the attempt starts (a missing one fails it, naming it)."""
    return {f"input:{name}": f"/work/inputs/{name}" for name in input_names(command)}


class ScopeCheck:
    """The scopes of each task type's plugins, gathered once per config: a type none of whose plugins has a
    scope (most of them) costs one dict look-up."""

    def __init__(self, settings: Settings) -> None:
        self._scopes: dict[str, list[tuple[str, Scope]]] = {}
        for task_type, task_settings in settings.all_types.items():
            found = [(plugin, plugin_scope(plugin, settings.plugins.defs.get(plugin), settings.execution.scope))
                     for plugin in task_settings.plugins]
            if scoped := [(plugin, scope) for plugin, scope in found if scope is not None]:
                self._scopes[task_type] = scoped

    async def __call__(self, task_type: str, payload: Mapping[str, Any], *, resolved: Resolved | None = None) -> None:
        """OutOfScope naming the payload field whose target lies outside the scope of a plugin of `task_type`
        (or whose name does not resolve). A field the payload lacks names no target and is not checked: a
        scan's later steps get theirs from what the steps before learn, and are checked when they start.
        `resolved`: the names a batch's earlier tasks resolved, not asked again."""
        for plugin, scope in self._scopes.get(task_type, ()):
            try:
                await scope.check_payload(payload, resolved=resolved)
                if plugin == "http_probe" and (host := _url_host(payload.get("url"))):
                    await scope.addresses(host, field="payload.url", resolved=resolved)
            except TargetRefused as exc:
                raise OutOfScope(exc.field, f"{str(exc).split(': ', 1)[1]} (plugin {plugin})") from None


def _url_host(url: object) -> str | None:
    """The host of http_probe's payload.url; None for what is no URL (the plugin itself refuses that)."""
    if not isinstance(url, str):
        return None
    try:
        return URL(url).raw_host
    except ValueError:
        return None
