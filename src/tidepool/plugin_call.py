"""One call of a plugin within an attempt: whatever the plugin raises ends that attempt, never its worker.

A library's SystemExit, a KeyboardInterrupt of the plugin's own, or a CancelledError nobody asked for
(awaiting a task it cancelled itself) would otherwise end the worker's loop as though the pool were
stopping it. Each becomes the attempt's failure; a cancellation that is ours goes on up.
"""

from __future__ import annotations

import asyncio

import anyio

from .context import TaskContext
from .errors import PluginError
from .plugins import PluginDef


class Escaped(PluginError):
    """What a plugin raised that is no Exception, as the failure of its attempt; the original is the cause."""


async def call_plugin(plugin: PluginDef, ctx: TaskContext) -> None:
    """Run a plugin. What it raises that is no Exception fails its attempt, as Escaped; a cancellation of
    ours (the attempt stopped, a deadline, shutdown) goes on up."""
    try:
        await plugin.run(ctx)
    except (Exception, GeneratorExit):  # GeneratorExit: the coroutine itself is being closed
        raise
    except BaseException as exc:
        # Ours only if a cancellation of this task is under way: anyio delivers every one of its scopes'
        # through asyncio's counted cancel. A stray one while the attempt's stop is pending but not yet
        # delivered (or under a shield) becomes the failure below, and the engine delivers the stop
        # at its next safe point.
        if isinstance(exc, anyio.get_cancelled_exc_class()) and _being_cancelled():
            raise
        raise Escaped(f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} raised") from exc


def _being_cancelled() -> bool:
    """A cancellation of this task is under way (anyio delivers its scopes' through asyncio's, counted)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
