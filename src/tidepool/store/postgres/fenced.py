"""A worker's fenced writes that end or add to its attempt: results, and how attempts ended.

Every one carries its lease (attempt id + token) and the time it was decided, so it lands only while
no one has expired or taken over that lease. Bare successes of many workers share one statement
(group commit); every other ending takes its task's row lock and is decided by lifecycle.decide_end.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import anyio

from ...errors import Conflict, LeaseLost, StoreUnavailable, TaskCancelling, TidepoolError
from ...lifecycle import Decision, RetryPolicy, decide_end
from ...model import AttemptStatus, Lease, Outcome, ResultBatch, State
from ..port import Ending
from ..rows import error_text, result_of
from ..rules import completable_at_once, may_end, progress_text
from . import scans
from .connection import Conn, Connections, said
from .group import Group
from .statements import SQL

Completion = tuple[Lease, float, dict[str, Any] | None]  # a bare success: its lease, its end time, its progress
log = logging.getLogger("tidepool.store.postgres")


class FencedWrites:
    def __init__(self, db: Connections) -> None:
        self._db = db
        self._completions: Group[Completion, bool] = Group(self._complete_group)
        self.told = scans.Told()  # the listener of the scans' moves these endings make

    async def drain(self) -> None:
        await self._completions.drain()

    async def record_result(self, lease: Lease, batch: ResultBatch, now: float) -> ResultBatch:
        """Stored once by key: a write whose answer was lost, sent again, comes back as the stored batch."""
        async with self._db.conn() as conn:
            fenced, stored = await conn.fetchrow(
                SQL["record_result"], lease.task_id, lease.attempt_id, lease.token, now, batch.idempotency_key,
                batch.plugin, batch.sequence, batch.sha256, batch.final, json.dumps(batch.payload))  # fmt: skip
            if not fenced:
                raise await why_lost(conn, lease)
            if stored:
                return replace(batch, attempt_id=lease.attempt_id)
            earlier = await conn.fetchrow(SQL["earlier_result"], batch.idempotency_key)
        if earlier is None:  # its task was pruned between the two statements
            raise StoreUnavailable(f"result key {batch.idempotency_key} changed hands during the write; retry")
        if earlier[3] != batch.sha256:
            raise Conflict(f"result key {batch.idempotency_key} was stored with another sha256")
        return result_of(earlier)

    async def finish_many(self, endings: Sequence[Ending], policy: RetryPolicy) -> list[State | TidepoolError]:
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
                done = await self._complete_group([(endings[i].lease, endings[i].now, endings[i].outcome.progress)
                                                   for i in fast])
            except StoreUnavailable:  # perhaps written with the answer lost: their own paths find out
                done = [False] * len(fast)
                maybe_written.update(fast)
            for i, completed in zip(fast, done, strict=True):
                if completed:
                    answers[i] = State.COMPLETED
        by_task: dict[str, list[int]] = {}
        for i, answer in enumerate(answers):
            if answer is None:
                by_task.setdefault(endings[i].lease.task_id, []).append(i)

        tried = set(fast)  # the grouped completion refused them (a scan's step, say): not asked twice

        async def end(indexes: list[int]) -> None:
            for i in indexes:
                answers[i] = await self._finish_one(endings[i], policy, maybe_written=i in maybe_written,
                                                    grouped=i not in tried)

        if by_task:
            async with anyio.create_task_group() as tg:
                for indexes in by_task.values():
                    tg.start_soon(end, indexes)
        return cast("list[State | TidepoolError]", answers)  # every slot answered above

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
        if grouped and completable_at_once([ending])[0] and await self._completions((lease, now, outcome.progress)):
            return State.COMPLETED
        moves: scans.Moves = []
        async with self._db.conn() as conn, conn.transaction():
            row = await conn.fetchrow(SQL["ending_row"], lease.task_id, lease.attempt_id, lease.token)
            if row is None or not may_end(State(row[0]), row[4], now):
                raise await why_lost(conn, lease)
            if row[5] is not None and outcome.status is AttemptStatus.SUCCEEDED:  # a scan step's success
                outcome = await scans.checked(conn, row[5], outcome)
            end = decide_end(State(row[0]), outcome, attempt=row[1], max_attempts=row[2], interruptions=row[3],
                             policy=policy, now=now)
            await write_ends(conn, [(lease, outcome, end)], now)
            if end.state in (State.PENDING, State.RETRY_WAIT) and (end.available_at or now) <= now:
                await conn.execute(SQL["notify"], "1")  # back in the queue at once (interrupted): others may take it
            if row[5] is not None and end.state.terminal:
                await scans.step_ended(conn, moves, scan_id=row[5], index=row[6], task_id=lease.task_id,
                                       state=end.state, learned=outcome.scope if end.state is State.COMPLETED else None,
                                       now=now)
        self.told(moves)
        return end.state

    async def _complete_group(self, calls: list[Completion]) -> list[bool]:
        """Bare successes of many workers, fenced and completed in one statement; False: the slow path."""
        leases = [lease for lease, _, _ in calls]
        async with self._db.conn(rows=len(calls)) as conn:
            done = await conn.fetch(SQL["complete"], *lease_arrays(leases), [now for _, now, _ in calls],
                                    [progress_text(p) for _, _, p in calls])
        completed = {r[0] for r in done}
        return [lease.attempt_id in completed for lease in leases]


def lease_arrays(leases: Sequence[Lease]) -> tuple[list[str], list[str], list[str]]:
    return [x.task_id for x in leases], [x.attempt_id for x in leases], [x.token for x in leases]


async def lost(conn: Conn, leases: Sequence[Lease], kept: set[str]) -> dict[str, LeaseLost]:
    """The leases a multi-row write did not take, each with why (read afresh: a cancel may have won)."""
    missed = [lease for lease in leases if lease.attempt_id not in kept]
    if not missed:
        return {}
    cancelling = {r[0] for r in await conn.fetch(SQL["cancelling"], *lease_arrays(missed))}
    return {
        x.attempt_id: TaskCancelling(x.task_id, x.attempt_id) if x.attempt_id in cancelling
        else LeaseLost(x.task_id, x.attempt_id)
        for x in missed
    }  # fmt: skip


async def why_lost(conn: Conn, lease: Lease) -> LeaseLost:
    if await conn.fetchval(SQL["why_lost"], lease.task_id, lease.attempt_id, lease.token) == State.CANCELLING:
        return TaskCancelling(lease.task_id, lease.attempt_id)
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
