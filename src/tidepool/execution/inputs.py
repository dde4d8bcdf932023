"""Inputs: the blobs a task names, placed read-only in its attempt's work directory before it runs.

Each input NAME becomes the file `{workdir}/inputs/NAME` (mode 0444), written by the store (a remote worker's
fetches it from its gateway); the stop phase removes it with the rest of the work directory. A blob the
store does not have fails the attempt `inputs_unavailable`, not retried: it will not be there the next time
either. A store that does not answer is asked again for as long as the lease is held, as for results.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import anyio

from ..errors import BlobNotFound, InvalidArgument, PluginError, StoreUnavailable
from ..model import Task, file_name_error
from ..store.port import WorkerPort
from .leases import Held

INPUTS_DIR = "inputs"


def input_paths(task: Task, workdir: str) -> dict[str, Path]:
    """Where each input of the task is placed: name -> path."""
    return {name: Path(workdir, INPUTS_DIR, name) for name in task.inputs}


async def place_inputs(store: WorkerPort, held: Held, task: Task, workdir: str) -> dict[str, Path]:
    """Write each input of the task to its path, read-only; name -> path."""
    paths = input_paths(task, workdir)
    await anyio.to_thread.run_sync(lambda: Path(workdir, INPUTS_DIR).mkdir(parents=True, exist_ok=True))
    for name, path in paths.items():
        if (why := file_name_error(name)) is not None:  # checked at submit; a path is made of it here
            raise InvalidArgument(f"inputs.{name}", why)
        await _place(store, held, name, task.inputs[name], path)
        await anyio.to_thread.run_sync(path.chmod, 0o444)
    return paths


async def _place(store: WorkerPort, held: Held, name: str, sha256: str, path: Path) -> None:
    async def once() -> None:
        try:
            await store.place_input(held.lease, sha256, path)
        except StoreUnavailable:
            with contextlib.suppress(FileNotFoundError):  # what a try cut short left: the next writes it anew
                await anyio.to_thread.run_sync(path.unlink)
            raise

    try:
        await held.asking(once)
    except BlobNotFound:
        raise PluginError(f"input {name}: the store has no blob {sha256} (deleted since the submit, or never "
                          "uploaded there); submit the task again with its file",
                          code="inputs_unavailable", retryable=False) from None
