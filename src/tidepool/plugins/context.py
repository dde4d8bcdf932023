"""PluginContext: what a plugin may use of its attempt, declared here so that plugins need nothing of the engine.

The engine hands each plugin a `tidepool.TaskContext`, which has this and more (a logger, a checkpoint);
the registry and the built-in plugins are written against this much only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ..model import Artifact, ResultBatch, Task


class PluginContext(Protocol):
    """One attempt as its plugins see it: its task and payload, a scope shared by its plugins, its own work
    directory and the task's inputs placed in it, progress, results and artifacts to report, and the last
    command's exit status and stderr tail to keep."""

    exit_status: int | None
    stderr_tail: str | None

    @property
    def task(self) -> Task: ...

    @property
    def payload(self) -> dict[str, Any]: ...

    @property
    def scope(self) -> dict[str, Any]: ...

    @property
    def workdir(self) -> str: ...

    @property
    def inputs(self) -> Mapping[str, Path]: ...

    def progress(self, fraction: float, message: str = "") -> None: ...

    async def emit(self, result: Any, *, final: bool = False, key: str | None = None) -> ResultBatch: ...

    async def artifact(self, name: str, source: Path | str | bytes, *,
                       content_type: str | None = None) -> Artifact: ...
