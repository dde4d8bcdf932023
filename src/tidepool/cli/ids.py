"""Task ids as a person types and reads them: a unique prefix names a task, as git's abbreviations do.

An id is 32 hex digits whose first 12 are its creation's millisecond (model.new_id), so the tasks of one
batch share all but their last digits, and a short form is only as short as the tasks around it allow.
"""

from __future__ import annotations

import asyncio
import os.path
import re

from ..client import ApiError, Client

ID_DIGITS = 32
MIN_PREFIX = 4  # fewer digits name a task only by luck
MIN_SHOWN = 12  # a task's millisecond: what tells apart tasks submitted one by one
_PREFIX = re.compile(f"[0-9a-f]{{{MIN_PREFIX},{ID_DIGITS - 1}}}")


class Ambiguous(ApiError):
    def __init__(self, prefix: str, ids: list[str]) -> None:
        super().__init__(400, "ambiguous_id", f"task id prefix {prefix} is ambiguous: {', '.join(ids)} and maybe "
                                              "more; give more of its digits")


async def resolve(client: Client, given: str) -> str:
    """The id of the one task whose id starts with `given`; `given` itself when it is no prefix (the daemon
    then says whether such a task exists). Tasks are listed newest first from the highest id the prefix
    allows, so the first two listed tell whether it names one task."""
    if not _PREFIX.fullmatch(given):
        return given
    matches = await _highest_two(client, given)
    if not matches:
        raise ApiError(404, "not_found", f"task {given} not found: no task id starts with it")
    if len(matches) > 1:
        raise Ambiguous(given, matches)
    found: str = matches[0]
    return found


async def short_forms(client: Client, ids: list[str]) -> dict[str, str]:
    """Each id by its shortest prefix, of at least MIN_SHOWN digits, that names it alone in the store: the
    form `show`, `cancel` and `retry` take back. Ids are compared with their neighbours in the list first
    (the longest prefix one shares is with one of them), then each is asked of the daemon as resolve() asks."""
    ordered = sorted(set(ids))
    guesses = {}
    for i, task_id in enumerate(ordered):
        near = [other for other in ordered[max(0, i - 1):i + 2] if other != task_id]
        guesses[task_id] = task_id[:max([MIN_SHOWN, *(_common(task_id, other) + 1 for other in near)])]
    found = await asyncio.gather(*(_unique(client, task_id, guess) for task_id, guess in guesses.items()))
    return dict(zip(guesses, found, strict=True))


async def _unique(client: Client, task_id: str, prefix: str) -> str:
    while len(prefix) < ID_DIGITS:
        others = [other for other in await _highest_two(client, prefix) if other != task_id]
        if not others:
            return prefix
        prefix = task_id[:max(_common(task_id, other) for other in others) + 1]
    return task_id


async def _highest_two(client: Client, prefix: str) -> list[str]:
    """The two highest ids that start with `prefix`. A list's cursor is exclusive, so the highest id the prefix
    allows (its other digits all f) is not listed from itself: it is asked for on its own."""
    top = prefix.ljust(ID_DIGITS, "f")
    page = await client.list(limit=2, cursor=top)
    found = [t["id"] for t in page["tasks"] if t["id"].startswith(prefix)]
    try:
        await client.get(top)
    except ApiError as exc:
        if exc.status != 404:
            raise
        return found
    return [top, *found][:2]


def _common(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))  # noqa: RUF071  # ids, not paths: by character is meant
