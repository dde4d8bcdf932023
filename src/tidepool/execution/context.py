"""TaskContext: what a Python plugin sees of its task, and how it reports back.

It is the plugins' PluginContext made concrete, with what plugin authors get besides (a logger bound to
the task, a checkpoint); `tidepool.TaskContext` is this class.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import anyio.lowlevel

from ..errors import InvalidArgument
from ..model import Artifact, ResultBatch, Task, file_name_error, sha256_of
from ..store import values
from .resources import Slot


class TaskContext:
    """Handed to every plugin of one attempt.

    `scope` is shared by the attempt's plugins: what an earlier one puts there, later ones see.
    `resource` is the slot acquired in the prepare phase, None for a task that needs no tags.
    `inputs` is each input's file, name -> path, placed read-only in the work directory before the run.
    """

    def __init__(self, task: Task, *, attempt_id: str, workdir: str, resource: Slot | None = None,
                 report_progress: Callable[[TaskContext, float, str], None],
                 store_result: Callable[[ResultBatch], Awaitable[ResultBatch]],
                 store_artifact: Callable[[str, Path | bytes, str | None], Awaitable[Artifact]]) -> None:
        self.task = task
        self.attempt_id = attempt_id
        self._workdir = workdir
        self.resource = resource
        self.scope: dict[str, Any] = {}
        self.plugin = ""
        self._log: logging.LoggerAdapter[logging.Logger] | None = None
        self._report_progress = report_progress
        self._store_result = store_result
        self._store_artifact = store_artifact
        self.inputs: dict[str, Path] = {}
        self._sequence: dict[str, int] = {}
        self.workdir_used = False             # set once a plugin asks for workdir; the stop phase removes it
        self.exit_status: int | None = None   # set by command plugins, kept on the attempt
        self.stderr_tail: str | None = None

    @property
    def payload(self) -> dict[str, Any]:
        return self.task.payload

    @property
    def workdir(self) -> str:
        """This attempt's own directory. It is not made for a plugin: one that wants it makes it, and the
        stop phase removes it however the attempt ended (asked for, it is looked for there)."""
        self.workdir_used = True
        return self._workdir

    @property
    def log(self) -> logging.LoggerAdapter[logging.Logger]:
        """A logger bound to the task id and the running plugin: each line starts with them."""
        if self._log is None or self._log.extra != {"task_id": self.task.id, "plugin": self.plugin}:
            self._log = _PluginLog(_PLUGIN_LOG, {"task_id": self.task.id, "plugin": self.plugin})
        return self._log

    def enter_plugin(self, name: str) -> None:
        self.plugin = name

    async def checkpoint(self) -> None:
        """A safe point: raises the attempt's cancellation here if a cancel or timeout is pending."""
        await anyio.lowlevel.checkpoint()

    def progress(self, fraction: float, message: str = "") -> None:
        self._report_progress(self, min(1.0, max(0.0, float(fraction))), message)

    async def emit(self, result: Any, *, final: bool = False, key: str | None = None) -> ResultBatch:
        """Store a result batch; the same key and content twice is acknowledged once, the same key with other
        content is refused (Conflict). A key of the plugin's own is its task's (stored as `<task id>:<key>`):
        the same key in another task is another result, not that one's acknowledgement. Without a key, each
        emit of the attempt is its own."""
        sequence = self._sequence.get(self.plugin, 0)
        self._sequence[self.plugin] = sequence + 1
        stored_key = f"{self.task.id}:{key}" if key else f"{self.attempt_id}:{self.plugin}:{sequence}"
        result = values.json_value(result)  # as the store keeps it: the acknowledgement is of this batch
        try:
            digest = sha256_of(result)
        except (TypeError, ValueError) as exc:  # a set, an object, NaN: stored, no client could read it back
            raise InvalidArgument("result", f"not JSON: {exc}") from None
        batch = ResultBatch(self.plugin, sequence, stored_key, digest, final, result, self.attempt_id)
        ack = await self._store_result(batch)
        if ack != batch and self._sequence[self.plugin] == sequence + 1:
            self._sequence[self.plugin] = sequence  # an earlier batch acknowledged: this number is still free
        return ack

    async def artifact(self, name: str, source: Path | str | bytes, *, content_type: str | None = None) -> Artifact:
        """Record `source` (a file of the work directory, or bytes) as the attempt's artifact `name`. Once per
        name: the same bytes again are the earlier record, other bytes Conflict. Past [artifacts]'
        quotas, QuotaExceeded (artifact_quota) or BlobTooLarge, and nothing is recorded: the attempt may
        still finish. A bad name, or a path outside the work directory (by `..` or a link), InvalidArgument."""
        if (why := file_name_error(name)) is not None:
            raise InvalidArgument(f"artifact {name!r}", why)
        if not isinstance(source, bytes):
            source = await anyio.to_thread.run_sync(self._in_workdir, name, source)
        return await self._store_artifact(name, source, content_type)

    def _in_workdir(self, name: str, source: Path | str) -> Path:
        """The file `source` (relative: to the work directory) is, links followed, if it lies inside the work
        directory: the store reads that path, never the link that led there."""
        root = Path(self._workdir).resolve()
        try:
            path = (root / source).resolve(strict=True)  # an absolute source stays itself
        except (OSError, RuntimeError) as exc:  # RuntimeError: a loop of links
            raise InvalidArgument(f"artifact {name!r}", f"cannot read {str(source)!r}: {exc}") from None
        if not path.is_relative_to(root):
            raise InvalidArgument(f"artifact {name!r}", f"{str(source)!r} is outside the work directory {root}")
        if not path.is_file():
            raise InvalidArgument(f"artifact {name!r}", f"{str(source)!r} is not a regular file")
        return path


_PLUGIN_LOG = logging.getLogger("tidepool.plugin")


class _PluginLog(logging.LoggerAdapter[logging.Logger]):
    """Lines that start "task <id> plugin <name>:", as every line about a task starts with its id (the text
    format shows no extra fields); the JSON format has both as fields too."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        assert self.extra is not None
        kwargs["extra"] = {**kwargs.get("extra", {}), **self.extra}  # the task and plugin are not the caller's
        return f"task {self.extra['task_id']} plugin {self.extra['plugin']}: {msg}", kwargs
