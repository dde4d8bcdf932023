"""Files to and from tasks on the command line: `--input NAME=FILE` of submit and scan (each file uploaded, then
named by its sha256 in the submit), `tidepool artifacts TASK` and `tidepool fetch TASK NAME`.

A file is never read whole into memory: its sha256 is computed in pieces, it goes up in pieces, and a download
is written to a temporary file beside its target, checked against the artifact's sha256 and only then renamed
into place, so a broken or altered transfer never leaves a file that looks complete.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from ..client import Client
from ..model import file_name_error
from ..settings import Settings
from .ids import resolve
from .output import ERR, OK, UNREACHABLE, USAGE, complain, print_json, stdout, table, text, visible, when
from .talk import with_client

PROGRESS_FROM_BYTES = 8 << 20  # a smaller file comes and goes too fast for a bar to say anything


class InputError(ValueError):
    """An --input the command cannot take: the message names it."""


def add_input_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", action="append", default=[], metavar="NAME=FILE",
                        help="a file the task gets as inputs/NAME (uploaded first); repeatable")


def parse_inputs(given: list[str]) -> dict[str, Path]:
    """`NAME=FILE` each, as name -> path; InputError naming the one that is wrong (checked before anything is
    uploaded, so one bad --input leaves nothing behind on the daemon)."""
    inputs: dict[str, Path] = {}
    for item in given:
        name, sep, file = item.partition("=")
        if not sep or not file:
            raise InputError(f"--input {item!r}: expected NAME=FILE")
        if (why := file_name_error(name)) is not None:
            raise InputError(f"--input {name!r}: the name {why}")
        if name in inputs:
            raise InputError(f"--input {name!r}: given twice")
        path = Path(file).expanduser()
        if not path.is_file():
            raise InputError(f"--input {name}={file}: no such file")
        inputs[name] = path
    return inputs


def file_sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


async def upload_inputs(client: Client, inputs: dict[str, Path]) -> dict[str, str]:
    """Each file uploaded (its sha256 sent along, so that bytes changed on the way are refused): name -> sha256."""
    named = {}
    for name, path in inputs.items():
        sha256 = file_sha256(path)
        with _bar(f"upload {name}", path.stat().st_size) as advance:
            blob = await client.upload(path, sha256=sha256, on_bytes=advance)
        named[name] = blob["sha256"]
    return named


@contextlib.contextmanager
def _bar(label: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr for a big transfer to or from a terminal; otherwise nothing is drawn."""
    if not ERR.is_terminal or total is None or total < PROGRESS_FROM_BYTES:
        yield lambda n: None
        return
    with Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=ERR,
                  transient=True) as progress:
        task = progress.add_task(visible(label), total=total)
        yield lambda n: progress.advance(task, n)


# artifacts and fetch

def artifact_rows(artifacts: list[dict[str, Any]]) -> Any:
    rows = table("name", "size", "type", "attempt", "sha256", "created (UTC)")
    for a in artifacts:
        rows.add_row(*map(text, (a["name"], str(a["size"]), a["content_type"] or "-", a["attempt_id"], a["sha256"],
                                 when(a["created_at"]))))
    return rows


def cmd_artifacts(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        artifacts = await client.artifacts(await resolve(client, args.task_id))
        if args.json:
            print_json({"artifacts": artifacts})
        elif not artifacts:
            print("no artifacts", file=sys.stderr)
        else:
            stdout().print(artifact_rows(artifacts))
        return OK

    return with_client(args, settings, body)


def cmd_fetch(args: argparse.Namespace, settings: Settings) -> int:
    if (why := file_name_error(args.name)) is not None:
        complain(f"tidepool: {args.name!r}: an artifact's name {why}")
        return USAGE
    target = Path(args.output or args.name)
    if target.is_dir():
        target = target / args.name

    async def body(client: Client) -> int:
        task_id = await resolve(client, args.task_id)
        artifact = _newest(await client.artifacts(task_id), args.name, args.attempt)
        if artifact is None:
            of = f" of attempt {args.attempt}" if args.attempt else ""
            complain(f"tidepool: task {task_id} has no artifact {args.name!r}{of} (`tidepool artifacts {task_id}` "
                     "lists them)")
            return USAGE
        path = f"/v1/tasks/{quote(task_id, safe='')}/artifacts/{args.name}?attempt={quote(artifact['attempt_id'])}"
        got = await _fetched(client, path, target.absolute(), artifact)
        if got != artifact["sha256"]:
            complain(f"tidepool: {args.name}: the bytes that came have sha256 {got}, not the artifact's "
                     f"{artifact['sha256']}; {target} was left as it was")
            return UNREACHABLE
        print(visible(f"{target}: {artifact['size']} bytes, sha256 {got}"), file=sys.stderr)
        return OK

    return with_client(args, settings, body)


def _newest(artifacts: list[dict[str, Any]], name: str, attempt: str | None) -> dict[str, Any] | None:
    named = [a for a in artifacts if a["name"] == name and attempt in (None, a["attempt_id"])]
    return named[-1] if named else None  # oldest first: the last is the newest attempt's


async def _fetched(client: Client, path: str, target: Path, artifact: dict[str, Any]) -> str:
    """The sha256 of what `path` answered, streamed into a temporary file beside `target` (an absolute path; beside
    it, so the rename stays on one file system), which becomes `target` only when it is the artifact's."""
    digest = hashlib.sha256()
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as into, _bar(f"fetch {artifact['name']}", artifact["size"]) as advance:
            def write(piece: bytes) -> None:
                digest.update(piece)
                into.write(piece)
                advance(len(piece))

            await client.download(path, write)
        if digest.hexdigest() == artifact["sha256"]:
            os.replace(temp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    return digest.hexdigest()


def add_commands(add: Any) -> None:
    p = add("artifacts", cmd_artifacts, "list the files a task's attempts recorded", json=True)
    p.add_argument("task_id", help="its id, or enough of its first digits")
    p = add("fetch", cmd_fetch, "download one of a task's artifacts, its sha256 checked")
    p.add_argument("task_id", help="its id, or enough of its first digits")
    p.add_argument("name", help="the artifact's name, as `tidepool artifacts` lists it")
    p.add_argument("-o", "--output", help="where to write it (default: ./NAME; a directory: NAME in it)")
    p.add_argument("--attempt", help="the attempt whose artifact to fetch (default: the newest attempt's)")
