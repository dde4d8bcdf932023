"""Claims: leases on the queue's head, many claimers' at once in one statement per claim filter."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...model import Claimed, ClaimFilter, Lease, Worker, new_id, new_token
from ..rows import task_of
from .connection import Connections
from .group import Group
from .statements import SQL

MAX_CLAIM_GROUPS = 64  # claim filters remembered; tag sets change as resource slots come and go


@dataclass(frozen=True, slots=True, eq=False)
class _ClaimCall:
    worker: Worker
    limit: int
    now: float
    lease_s: float


class Claims:
    def __init__(self, db: Connections) -> None:
        self._db = db
        self._groups: dict[ClaimFilter, Group[_ClaimCall, list[Claimed]]] = {}

    async def drain(self) -> None:
        """Until the claims already queued have been sent."""
        for group in list(self._groups.values()):
            await group.drain()

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        if limit <= 0:
            return []
        group = self._groups.get(where)
        if group is None:
            if len(self._groups) >= MAX_CLAIM_GROUPS:
                self._groups = {k: g for k, g in self._groups.items() if g.busy}
            group = self._groups[where] = Group(lambda calls: self._group(where, calls))
        return await group(_ClaimCall(worker, limit, now, lease_s))

    async def _group(self, where: ClaimFilter, calls: list[_ClaimCall]) -> list[list[Claimed]]:
        """Leases for every queued claim of one filter in one statement, split in queue order."""
        slots = [(call, new_id(call.now), new_token()) for call in calls for _ in range(call.limit)]
        patterns = None if where.types is None else [exactly(t) for t in where.types]
        tag_sets = json.dumps([sorted(s) for s in where.tag_sets]) if where.tag_sets else None
        async with self._db.conn(rows=len(slots)) as conn:
            rows = await conn.fetch(
                SQL["claim"], min(c.now for c in calls), len(slots), [s[1] for s in slots], [s[2] for s in slots],
                [s[0].worker.node_id for s in slots], [s[0].worker.instance_id for s in slots],
                [s[0].worker.worker_id for s in slots], [s[0].now for s in slots],
                [s[0].now + s[0].lease_s for s in slots], patterns, tag_sets,
                None if where.organizations is None else list(where.organizations))  # fmt: skip
        claimed: dict[int, list[Claimed]] = {id(c): [] for c in calls}
        for row in rows:  # ordered by slot: each claim gets its run of the queue's head
            call, attempt_id, token = slots[row[0] - 1]
            task = task_of(row[1:], required_tags=row[12])
            claimed[id(call)].append(Claimed(task, Lease(task.id, attempt_id, token, call.now + call.lease_s)))
        return [claimed[id(c)] for c in calls]


def exactly(name: str) -> str:
    """An anchored PostgreSQL regex that matches `name` and nothing else: the claim function of the schema
    matches types by regex. A backslash makes an ASCII character other than a letter or digit literal; no
    other character means anything but itself there."""
    return "^" + "".join(c if c.isalnum() or not c.isascii() else "\\" + c for c in name) + "$"
