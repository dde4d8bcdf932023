"""Short task ids: a prefix the CLI shows must name one task in the store, whatever digits the ids end in.

The daemon picks ids itself, so the edge case (an id whose digits after a prefix are all f, the highest
the prefix allows) is set up here with a store of chosen ids behind the two calls the CLI makes.
"""

from __future__ import annotations

from typing import Any

import pytest

from tidepool.cli import ids
from tidepool.client import ApiError

BATCH = "01a234a6743fea2ba4fdb52d25fe64"  # 30 digits: five tasks of one millisecond share them


class Listing:
    """What the daemon answers to `list` (newest first, below an exclusive cursor) and `get`."""

    def __init__(self, task_ids: list[str]) -> None:
        self.ids = sorted(task_ids, reverse=True)

    async def list(self, *, limit: int, cursor: str) -> dict[str, Any]:
        return {"tasks": [{"id": i} for i in self.ids if i < cursor][:limit]}

    async def get(self, task_id: str) -> dict[str, Any]:
        if task_id not in self.ids:
            raise ApiError(404, "not_found", f"task {task_id} not found")
        return {"id": task_id}


@pytest.mark.asyncio
async def test_a_short_form_is_not_taken_for_unique_when_its_neighbour_is_the_highest_id_it_allows() -> None:
    tasks = [BATCH + "1e", BATCH + "1f", BATCH + "20", BATCH + "21"]
    forms = await ids.short_forms(Listing(tasks), [BATCH + "1e"])  # shown alone, as on a list's last page
    assert forms == {BATCH + "1e": BATCH + "1e"}  # "...641" would name 1e and 1f both


@pytest.mark.asyncio
async def test_a_prefix_that_names_the_highest_id_it_allows_and_another_is_ambiguous() -> None:
    listing = Listing([BATCH + "1e", BATCH + "1f"])
    with pytest.raises(ids.Ambiguous):
        await ids.resolve(listing, BATCH + "1")
    assert await ids.resolve(listing, BATCH + "1f") == BATCH + "1f"
