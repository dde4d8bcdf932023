"""The leases: a worker's claims on the queue's head, and its fenced writes that keep, note and end them.

Every write carries its lease (attempt id + token) and the time it was decided, so it lands only while no
one has expired or taken over that lease. Claims of many workers share one statement per claim filter, and
bare successes of many workers share one statement too (group commit); every other ending takes its task's
row lock and is decided by lifecycle.decide_end.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import anyio

from ...errors import Conflict, DeadlinePassed, LeaseLost, StoreUnavailable, TaskCancelling, TidepoolError, ValueRefused
from ...lifecycle import Decision, RetryPolicy, decide_end
from ...model import AttemptStatus, Claimed, ClaimFilter, Lease, Outcome, ResultBatch, State, Worker, new_id, new_token
from .. import sql
from ..bounds import check_quota, past_deadline, payload_bytes
from ..port import Ending, PhaseNote, ResultQuota
from ..rows import error_text, result_of, task_of
from ..rules import completable_at_once, may_end, progress_text
from . import scans, tasks
from .database import Conn, Database, Group, said

SQL = sql.queries(__package__, "leases.sql")
CLAIM_FUNCTION = SQL["claim_function"]  # defined after the migrations, whenever a schema is migrated
MAX_CLAIM_GROUPS = 64  # claim filters remembered; tag sets change as resource slots come and go
Completion = scans.Success  # a bare success: its lease, its end time, how it ended (its progress, a step's scope)
log = logging.getLogger("tidepool.store.postgres")


@dataclass(frozen=True, slots=True, eq=False)
class _ClaimCall:
    worker: Worker
    limit: int
    now: float
    lease_s: float


class Leases:
    """The leases verbs of one store, with the groups their claims and bare successes share."""

    def __init__(self, db: Database, told: scans.Told) -> None:
        self._db = db
        self._told = told  # the listener of the scans' moves these endings make
        self._claims: dict[ClaimFilter, Group[_ClaimCall, list[Claimed]]] = {}
        self._completions: Group[Completion, bool] = Group(self._complete_group)

    async def drain(self) -> None:
        """Until the bare successes and claims already queued have been sent."""
        await self._completions.drain()
        for group in list(self._claims.values()):
            await group.drain()

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        if limit <= 0:
            return []
        group = self._claims.get(where)
        if group is None:
            if len(self._claims) >= MAX_CLAIM_GROUPS:
                self._claims = {k: g for k, g in self._claims.items() if g.busy}
            group = self._claims[where] = Group(lambda calls: self._claim_group(where, calls))
        return await group(_ClaimCall(worker, limit, now, lease_s))

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        if not leases:
            return {}
        async with self._db.conn(rows=len(leases)) as conn:
            renewed = await conn.fetch(SQL["renew"], *_lease_arrays(leases), now, now + lease_s)
            return await _lost(conn, leases, {r[0] for r in renewed}, now)

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        if not notes:
            return {}
        latest = list({n.lease.attempt_id: n for n in notes}.values())  # one row per lease: the last note
        leases = [n.lease for n in latest]
        phases = [n.phase.value for n in latest]
        progress = [progress_text(n.progress) for n in latest]
        # the latest note may be a progress note after the one that started the run phase: the first deadline sent
        sent: dict[str, float] = {}
        for n in notes:
            if n.deadline_s is not None:
                sent.setdefault(n.lease.attempt_id, n.deadline_s)
        deadlines = [sent.get(n.lease.attempt_id) for n in latest]
        async with self._db.conn(rows=len(latest)) as conn:
            noted = await conn.fetch(SQL["set_phase"], *_lease_arrays(leases), phases, progress, now, deadlines)
            return await _lost(conn, leases, {r[0] for r in noted}, now)

    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float,
                            quota: ResultQuota | None = None) -> ResultBatch:
        """Stored once by key: a write whose answer was lost, sent again, comes back as the stored batch."""
        size = payload_bytes(batch)
        async with self._db.conn() as conn:
            fenced, stored, room, count, stored_bytes = await conn.fetchrow(
                SQL["record_result"], lease.task_id, lease.attempt_id, lease.token, now, batch.idempotency_key,
                batch.plugin, batch.sequence, batch.sha256, batch.final, json.dumps(batch.payload),
                None if quota is None else quota.max_results, size,
                None if quota is None else quota.max_bytes)  # fmt: skip
            if not fenced:
                raise await why_lost(conn, lease, now)
            if stored:
                return replace(batch, attempt_id=lease.attempt_id, stored_now=True)
            earlier = await conn.fetchrow(SQL["earlier_result"], batch.idempotency_key)
        if earlier is None and not room:
            check_quota(quota, task_id=lease.task_id, attempt_id=lease.attempt_id, count=count,
                        stored_bytes=stored_bytes, adding=size)
        if earlier is None:  # its task was pruned between the two statements
            raise StoreUnavailable(f"result key {batch.idempotency_key} changed hands during the write; retry")
        if earlier[3] != batch.sha256:
            raise Conflict(f"result key {batch.idempotency_key} was stored with another sha256")
        return result_of(earlier)

    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        result = (await self.finish_many([Ending(lease, outcome, now)], policy=policy))[0]
        if isinstance(result, TidepoolError):
            raise result
        return result

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        """Bare successes of distinct tasks in one statement (the common case, no task started); every
        other ending on its own path, each task's endings in order so a later one meets the fence an earlier
        one left, all tasks at once."""
        if len(endings) == 1:  # finish(): nothing to share
            return [await self._finish_one(endings[0], policy, maybe_written=endings[0].resent)]
        answers: list[State | TidepoolError | None] = [None] * len(endings)
        maybe_written = {i for i, ending in enumerate(endings) if ending.resent}
        fast = [i for i, ok in enumerate(completable_at_once(endings)) if ok]
        if fast:
            try:
                done = await self._complete_group([(endings[i].lease, endings[i].now, endings[i].outcome)
                                                   for i in fast])
            except (StoreUnavailable, ValueRefused):  # perhaps written, or one refused: their own paths find out
                done = [False] * len(fast)
                maybe_written.update(fast)
            for i, completed in zip(fast, done, strict=True):
                if completed:
                    answers[i] = State.COMPLETED
        by_task: dict[str, list[int]] = {}
        for i, answer in enumerate(answers):
            if answer is None:
                by_task.setdefault(endings[i].lease.task_id, []).append(i)

        tried = set(fast)  # the grouped completion refused them (a scope its scan refuses, say): not asked twice

        async def end(indexes: list[int]) -> None:
            for i in indexes:
                answers[i] = await self._finish_one(endings[i], policy, maybe_written=i in maybe_written,
                                                    grouped=i not in tried)

        if by_task:
            async with anyio.create_task_group() as tg:
                for indexes in by_task.values():
                    tg.start_soon(end, indexes)
        return cast("list[State | TidepoolError]", answers)  # every slot answered above

    async def _claim_group(self, where: ClaimFilter, calls: list[_ClaimCall]) -> list[list[Claimed]]:
        """Leases for every queued claim of one filter in one statement, split in queue order."""
        slots = [(call, new_id(call.now), new_token()) for call in calls for _ in range(call.limit)]
        patterns = None if where.types is None else [exactly(t) for t in where.types]
        tag_sets = json.dumps([sorted(s) for s in where.tag_sets]) if where.tag_sets else None
        async with self._db.conn(rows=len(slots)) as conn:
            rows = await claim_rows(
                conn, min(c.now for c in calls), len(slots), [s[1] for s in slots], [s[2] for s in slots],
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

    async def _finish_one(self, ending: Ending, policy: RetryPolicy, *, maybe_written: bool = False,
                          grouped: bool = True) -> State | TidepoolError:
        """One ending; its error returned, not raised. `maybe_written`: an earlier write of it may have
        committed unanswered, so meeting its own fence is not yet a refusal. `grouped`: a bare success may
        try the grouped completion first (not when it was refused there already)."""
        lease = ending.lease
        try:
            try:
                return await self._finish(ending, policy, grouped=grouped)
            except LeaseLost:
                if maybe_written and (done := await self._ended(lease, ending.now)) is not None:
                    return done  # that earlier try did land
                raise
        except TidepoolError as exc:
            return exc
        except Exception as exc:
            log.error("task %s attempt %s: finish failed: %r", lease.task_id, lease.attempt_id, exc)
            error = StoreUnavailable(f"task {lease.task_id} attempt {lease.attempt_id}: finish failed: {said(exc)}")
            error.__cause__ = exc
            return error

    async def _ended(self, lease: Lease, now: float) -> State | None:
        """After a resent finish met its own fence: the task's state if this very write had in fact ended
        the attempt. Its end time tells it from an end someone else wrote meanwhile (the reconciler's
        cancel deadline, say), which this worker must not report a second time."""
        async with self._db.conn() as conn:
            row = await conn.fetchrow(SQL["ended_at"], lease.attempt_id, now)
        ended = row is not None and row[1] not in ("leased", "running", "expired")
        return State(row[0]) if ended else None

    async def _finish(self, ending: Ending, policy: RetryPolicy, *, grouped: bool = True) -> State:
        lease, outcome, now = ending.lease, ending.outcome, ending.now
        if grouped and completable_at_once([ending])[0] and await self._completions((lease, now, outcome)):
            return State.COMPLETED
        moves: scans.Moves = []
        async with self._db.conn() as conn, conn.transaction():
            row = await conn.fetchrow(SQL["ending_row"], lease.task_id, lease.attempt_id, lease.token)
            if row is None or not may_end(State(row[0]), row[4], now):
                raise await why_lost(conn, lease, now)
            if row[5] is not None and outcome.status is AttemptStatus.SUCCEEDED:  # a scan step's success
                outcome = await scans.checked(conn, row[5], outcome)
            end = decide_end(State(row[0]), outcome, attempt=row[1], max_attempts=row[2], interruptions=row[3],
                             policy=policy, now=now)
            await write_ends(conn, [(lease, outcome, end)], now)
            if end.state in (State.PENDING, State.RETRY_WAIT) and (end.available_at or now) <= now:
                await tasks.notify(conn, 1)  # back in the queue at once (interrupted): others may take it
            if row[5] is not None and end.state.terminal:
                await scans.step_ended(conn, moves, scan_id=row[5], index=row[6], task_id=lease.task_id,
                                       state=end.state, learned=outcome.scope if end.state is State.COMPLETED else None,
                                       now=now)
        self._told(moves)
        return end.state

    async def _complete_group(self, calls: list[Completion]) -> list[bool]:
        """Bare successes of many workers, fenced and completed in one statement, the scan steps among them
        (which that refuses) then together with their scans' moves; False: the slow path."""
        leases = [lease for lease, _, _ in calls]
        async with self._db.conn(rows=len(calls)) as conn:
            done = await conn.fetch(SQL["complete"], *_lease_arrays(leases), [now for _, now, _ in calls],
                                    [progress_text(o.progress) for _, _, o in calls])
            completed = {r[0] for r in done}
            if len(completed) < len(calls):
                completed |= await scans.succeeded(conn, self._told,
                                                   [c for c in calls if c[0].attempt_id not in completed])
        return [lease.attempt_id in completed for lease in leases]


async def claim_rows(conn: Conn, now: float, limit: int, attempt_ids: list[str], tokens: list[str],
                     node_ids: list[str], instance_ids: list[str], worker_ids: list[str], nows: list[float],
                     expires: list[float], type_patterns: list[str] | None, tag_sets: str | None,
                     organizations: list[str] | None) -> list[Any]:
    """The rows the claim function leased, one array element per slot: each row's slot number, then the
    task's columns, in slot order."""
    rows: list[Any] = await conn.fetch(SQL["claim"], now, limit, attempt_ids, tokens, node_ids, instance_ids,
                                       worker_ids, nows, expires, type_patterns, tag_sets, organizations)
    return rows


def exactly(name: str) -> str:
    """An anchored PostgreSQL regex that matches `name` and nothing else: the claim function of the schema
    matches types by regex. A backslash makes an ASCII character other than a letter or digit literal; no
    other character means anything but itself there."""
    return "^" + "".join(c if c.isalnum() or not c.isascii() else "\\" + c for c in name) + "$"


def _lease_arrays(leases: Sequence[Lease]) -> tuple[list[str], list[str], list[str]]:
    return [x.task_id for x in leases], [x.attempt_id for x in leases], [x.token for x in leases]


async def _lost(conn: Conn, leases: Sequence[Lease], kept: set[str], now: float) -> dict[str, LeaseLost]:
    """The leases a multi-row write did not take, each with why (read afresh: a cancel may have won)."""
    missed = [lease for lease in leases if lease.attempt_id not in kept]
    if not missed:
        return {}
    found = {r[0]: r for r in await conn.fetch(SQL["lost_why"], *_lease_arrays(missed))}
    return {x.attempt_id: _why(x, found.get(x.attempt_id), now) for x in missed}


async def why_lost(conn: Conn, lease: Lease, now: float) -> LeaseLost:
    row = await conn.fetchrow(SQL["why_lost"], lease.task_id, lease.attempt_id, lease.token)
    return _why(lease, None if row is None else (lease.attempt_id, row[0], row[1]), now)


def _why(lease: Lease, row: Any, now: float) -> LeaseLost:
    """Why a fenced write missed, from its (attempt id, task state, deadline_at) row if its task still names
    the lease: a cancel committed, the attempt past its run deadline, or else the lease is gone."""
    if row is not None and row[1] == State.CANCELLING:
        return TaskCancelling(lease.task_id, lease.attempt_id)
    if row is not None and past_deadline(row[2], now):
        return DeadlinePassed(lease.task_id, lease.attempt_id)
    return LeaseLost(lease.task_id, lease.attempt_id)


def expiry(row: Any, outcome: Outcome, policy: RetryPolicy, now: float) -> Decision:
    return decide_end(State(row[0]), outcome, attempt=row[1], max_attempts=row[2], interruptions=row[3],
                      policy=policy, now=now)


async def write_ends(conn: Conn, ends: list[tuple[Lease, Outcome, Decision]], now: float) -> None:
    """Write how attempts ended, all in one statement; the caller holds their task rows locked."""
    await conn.execute(
        SQL["write_ends"],
        [lease.task_id for lease, _, _ in ends],
        [lease.attempt_id for lease, _, _ in ends],
        [e.state.value for _, _, e in ends],
        [e.attempt_status.value for _, _, e in ends],
        [error_text(e.error) for _, _, e in ends],
        [1 if e.uncount_attempt else 0 for _, _, e in ends],
        [e.available_at for _, _, e in ends],
        [None if e.available_at is not None else now for _, _, e in ends],  # queued again: not finished
        [o.exit_status for _, o, _ in ends],
        [o.stderr_tail for _, o, _ in ends],
        [progress_text(o.progress) for _, o, _ in ends],
        now,
    )
