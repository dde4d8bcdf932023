"""The payload check: a submitted payload checked against the command templates its task type will fill in,
before it is queued.

The same rendering runs again when the attempt starts (a command plugin's own check); doing it at submit
makes a payload that no attempt could run a 400 naming the field, instead of a task that fails later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgument, InvalidRequest
from ..plugins.command import render_argv
from ..settings import Settings

# What the node fills in for every attempt: their values are the node's, never the payload's to get wrong.
STAND_INS = {"task_id": "0" * 32, "attempt": 1, "workdir": "/work"}


class PayloadCheck:
    """The command templates of each task type, gathered once per config: a submit of a type without
    commands (most of them) costs one dict look-up."""

    def __init__(self, settings: Settings) -> None:
        self._commands: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
        for task_type, task_settings in settings.all_types.items():
            specs = [(plugin, settings.plugins.defs.get(plugin)) for plugin in task_settings.plugins]
            commands = [(plugin, spec.command) for plugin, spec in specs if spec and spec.command is not None]
            if commands:
                self._commands[task_type] = commands

    def __call__(self, task_type: str, payload: Mapping[str, Any]) -> None:
        """InvalidRequest naming the payload field a command plugin of `task_type` could not put in its
        arguments: a placeholder with no value, a value starting with "-", one that is not a string or number."""
        for plugin, command in self._commands.get(task_type, ()):
            try:
                render_argv(command, {**payload, **STAND_INS})
            except InvalidArgument as exc:
                raise InvalidRequest(exc.field, f"{str(exc).split(': ', 1)[1]} (plugin {plugin}'s command)") from None
