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
        patterns = None if "*" in where.type_globs else [_glob_regex(g) for g in where.type_globs]
        tag_sets = json.dumps([sorted(s) for s in where.tag_sets]) if where.tag_sets else None
        async with self._db.conn() as conn:
            rows = await conn.fetch(
                SQL["claim"], min(c.now for c in calls), len(slots), [s[1] for s in slots], [s[2] for s in slots],
                [s[0].worker.node_id for s in slots], [s[0].worker.instance_id for s in slots],
                [s[0].worker.worker_id for s in slots], [s[0].now for s in slots],
                [s[0].now + s[0].lease_s for s in slots], patterns, tag_sets)  # fmt: skip
        claimed: dict[int, list[Claimed]] = {id(c): [] for c in calls}
        for row in rows:  # ordered by slot: each claim gets its run of the queue's head
            call, attempt_id, token = slots[row[0] - 1]
            task = task_of(row[1:], required_tags=row[12])
            claimed[id(call)].append(Claimed(task, Lease(task.id, attempt_id, token, call.now + call.lease_s)))
        return [claimed[id(c)] for c in calls]



def _glob_regex(glob: str) -> str:
    """An anchored PostgreSQL regex that matches what fnmatch.fnmatchcase(name, glob) matches."""
    out, i, n = ["^"], 0, len(glob)
    while i < n:
        c, i = glob[i], i + 1
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[" and (j := _class_end(glob, i)) is not None:
            out.append(_char_class(glob[i:j]))
            i = j + 1
        else:
            out.append(_literal(c))
    return "".join(out) + "$"


def _class_end(glob: str, i: int) -> int | None:
    """Where the class opened just before i closes, as fnmatch reads it; None: the `[` is literal."""
    j = i + 1 if i < len(glob) and glob[i] == "!" else i
    j = j + 1 if j < len(glob) and glob[j] == "]" else j
    j = glob.find("]", j)
    return None if j < 0 else j


def _char_class(body: str) -> str:
    negate = body.startswith("!")
    body = body[1:] if negate else body
    items, k = [], 0
    while k < len(body):
        if k + 2 < len(body) and body[k + 1] == "-":
            if body[k] <= body[k + 2]:  # fnmatch drops reversed ranges
                items.append(f"{_literal(body[k])}-{_literal(body[k + 2])}")
            k += 3
        else:
            items.append(_literal(body[k]))
            k += 1
    if not items:  # fnmatch: an empty class matches nothing, a negated one any character
        return "." if negate else "[^\\x00-\\U0010FFFF]"
    return f"[{'^' if negate else ''}{''.join(items)}]"


def _literal(c: str) -> str:
    # In PostgreSQL's regexes a backslash makes any non-alphanumeric character literal.
    return c if c.isalnum() or not c.isascii() else "\\" + c
