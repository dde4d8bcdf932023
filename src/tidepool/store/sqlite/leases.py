"""A worker's leases in the SQLite store: claims, renewals, phase notes, results and endings, run on the writer
thread.

Every write is fenced by its lease (attempt id + token). Claims and bare successes are gathered across the
ops of a transaction (Grouped) into a few statements per chunk of rows. A remote worker's acquire leases its
tasks with the claim's statements (workers.py); the reconciler's expiry ends attempts as a worker does (end).
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...errors import Conflict, DeadlinePassed, LeaseLost, TaskCancelling, TidepoolError
from ...lifecycle import RetryPolicy, decide_end
from ...model import AttemptStatus, Claimed, ClaimFilter, Lease, Outcome, ResultBatch, State, Worker, new_id, new_token
from .. import sql
from ..bounds import check_quota, past_deadline, payload_bytes
from ..port import Ending, PhaseNote, ResultQuota
from ..rows import error_text, result_of
from ..rules import completable_at_once, may_end, progress_text, sqlite_glob
from . import scans
from .database import Batch, Grouped, chunks, marks, run_alone, task_of

Q = sql.queries(__package__, "leases.sql")


def values(row: str, n: int) -> str:
    """`n` copies of a VALUES row of the named queries (a `*_row` query)."""
    return ",".join([Q[row]] * n)


# claims


def claimable(conn: sqlite3.Connection, where: ClaimFilter, limit: int, now: float,
              type_globs: Sequence[str] | None = None) -> list[Any]:
    """The rows `where` may lease now, in queue order; with type_globs, only types one of them matches."""
    if where.types == () or where.organizations == ():  # SQLite finds no plan for `x IN ()` on the queue index
        return []
    args: list[Any] = [now]
    types = ""
    if where.types is not None:
        types = f"AND type IN ({marks(len(where.types))})"
        args.extend(where.types)
    if type_globs:
        types += " AND (" + " OR ".join(["type GLOB ?"] * len(type_globs)) + ")"
        args.extend(sqlite_glob(g) for g in type_globs)
    tags = []
    for tag_set in where.tag_sets:
        tags.append(Q["claimable_tags"].format(marks=marks(len(tag_set))))
        args.extend(sorted(tag_set))
    args.append(limit)
    if where.organizations is None:
        return conn.execute(Q["claimable"].format(types=types, tags=" ".join(tags)), args).fetchall()
    share = Q["claimable_of_organization"].format(types=types, tags=" ".join(tags))
    union = " UNION ALL ".join([share] * len(where.organizations)) + " ORDER BY priority DESC, created_at, id LIMIT ?"
    return conn.execute(union, [x for org in where.organizations for x in (org, *args)] + [limit]).fetchall()


def lease(conn: sqlite3.Connection, leased: list[tuple[Worker, Claimed, float]]) -> None:
    """Lease the claimed rows and open their attempts: one statement each per chunk, not one per row."""
    for chunk in chunks(leased):
        conn.execute(Q["lease"].format(rows=values("lease_row", len(chunk))),
                     [x for w, c, now in chunk for x in (c.task.id, w.node_id, now, c.lease.attempt_id, c.lease.token,
                                                          c.lease.expires_at, w.instance_id)])
        conn.execute(Q["open_attempts"].format(rows=values("open_attempts_row", len(chunk))),
                     [x for w, c, now in chunk for x in (c.lease.attempt_id, c.task.id, c.task.id, w.node_id,
                                                          w.instance_id, w.worker_id, now)])


@dataclass(frozen=True)
class ClaimOp(Grouped):
    """Claims of one filter share a single ordered SELECT, then split its rows in queue order."""

    worker: Worker
    where: ClaimFilter
    limit: int
    now: float
    lease_s: float

    def group_key(self) -> object:
        return (ClaimOp, self.where)

    @classmethod
    def run_group(cls, conn: sqlite3.Connection, batch: Batch, ops: list[Any]) -> list[tuple[Any, None]]:
        rows = iter(claimable(conn, ops[0].where, sum(o.limit for o in ops), min(o.now for o in ops)))
        results: list[tuple[Any, None]] = []
        leased: list[tuple[Worker, Claimed, float]] = []
        for op in ops:
            mine = [r for _, r in zip(range(op.limit), rows, strict=False)]
            claimed = [Claimed(task_of(r, leased_by=op.worker.node_id, now=op.now),
                               Lease(r[0], new_id(op.now), new_token(), op.now + op.lease_s)) for r in mine]
            leased.extend((op.worker, c, op.now) for c in claimed)
            results.append((claimed, None))
        if leased:
            lease(conn, leased)
        if batch.queued is not None:
            batch.queued -= len(leased)
        return results


# what a worker writes behind its lease


def fence(lease: Lease) -> tuple[str, str, str]:
    return lease.task_id, lease.attempt_id, lease.token


def why_lost(conn: sqlite3.Connection, lease: Lease, now: float) -> LeaseLost:
    row = conn.execute(Q["fenced_state"], fence(lease)).fetchone()
    if row is not None and row[0] == State.CANCELLING:
        return TaskCancelling(lease.task_id, lease.attempt_id)
    if row is not None and past_deadline(row[1], now):
        return DeadlinePassed(lease.task_id, lease.attempt_id)
    return LeaseLost(lease.task_id, lease.attempt_id)


def renew(conn: sqlite3.Connection, batch: Batch, *, leases: Sequence[Lease], now: float,
          lease_s: float) -> dict[str, LeaseLost]:
    lost = {}
    for lease in leases:
        if conn.execute(Q["renew"], (now + lease_s, *fence(lease), now)).rowcount == 0:
            lost[lease.attempt_id] = why_lost(conn, lease, now)
    return lost


def set_phase(conn: sqlite3.Connection, batch: Batch, *, notes: Sequence[PhaseNote],
              now: float) -> dict[str, LeaseLost]:
    lost: dict[str, LeaseLost] = {}
    for chunk in chunks(notes):
        lost.update(note_phases(conn, chunk, now))
    return lost


def note_phases(conn: sqlite3.Connection, notes: Sequence[PhaseNote], now: float) -> dict[str, LeaseLost]:
    """Write the notes of live leases, two statements for the lot: the lease keeper flushes every running
    attempt's notes together, and a statement per note held the writer ~4 ms for 50 of them, with every
    claim queued behind it. The notes refused are found only when some were."""
    cur = conn.execute(Q["note_phases"].format(rows=values("note_phases_row", len(notes))),
                       [now, *(x for n in notes for x in (*fence(n.lease), n.phase, progress_text(n.progress))),
                        now])
    lost: dict[str, LeaseLost] = {}
    if cur.rowcount != len(notes):  # a written note leaves its task running under the same live lease
        for n in notes:
            if conn.execute(Q["noted"], (*fence(n.lease), now)).fetchone() is None:
                lost[n.lease.attempt_id] = why_lost(conn, n.lease, now)
    written = [n.lease.attempt_id for n in notes if n.lease.attempt_id not in lost]
    if written:  # an attempt's first note starts it
        conn.execute(Q["start_attempts"].format(marks=marks(len(written))), written)
    conn.executemany(Q["start_deadline"], [(now + n.deadline_s, n.lease.attempt_id) for n in notes
                                           if n.deadline_s is not None and n.lease.attempt_id not in lost])
    return lost


def record_result(conn: sqlite3.Connection, batch: Batch, *, lease: Lease, result: ResultBatch, now: float,
                  quota: ResultQuota | None = None) -> ResultBatch:
    row = conn.execute(Q["live_state"], (*fence(lease), now)).fetchone()
    if row is None or row[0] not in (State.LEASED, State.RUNNING):
        raise why_lost(conn, lease, now)
    earlier = conn.execute(Q["result_by_key"], (result.idempotency_key,)).fetchone()
    if earlier is not None:
        if earlier[3] != result.sha256:
            raise Conflict(f"result key {result.idempotency_key} was stored with another sha256")
        return result_of(earlier)
    size = payload_bytes(result)
    count, stored = conn.execute(Q["result_counts"], (lease.attempt_id,)).fetchone()
    check_quota(quota, task_id=lease.task_id, attempt_id=lease.attempt_id, count=count, stored_bytes=stored,
                adding=size)
    conn.execute(Q["insert_result"], (result.idempotency_key, lease.task_id, lease.attempt_id, result.plugin,
                                      result.sequence, result.sha256, result.final, json.dumps(result.payload), now))
    conn.execute(Q["count_result"], (size, lease.attempt_id))
    return replace(result, attempt_id=lease.attempt_id, stored_now=True)


# endings


@dataclass(frozen=True, eq=False)
class FinishOp(Grouped):
    """Attempts ending: the bare successes of the finish_many calls of one transaction completed a few
    statements at a time (the scan steps among them, refused by that, in a pass of their own that moves their
    scans too), every other ending (and every success those refused) alone in its own savepoint."""

    endings: tuple[Ending, ...]
    policy: RetryPolicy

    @classmethod
    def run_group(cls, conn: sqlite3.Connection, batch: Batch, ops: list[Any]) -> list[tuple[Any, None]]:
        flat: list[tuple[Ending, RetryPolicy]] = [(e, op.policy) for op in ops for e in op.endings]
        fast = completable_at_once([e for e, _ in flat])
        bare = [e for (e, _), f in zip(flat, fast, strict=True) if f]
        # the plain ones first: complete's fence refuses scan steps, and only what it refused meets the step
        # pass, so a round without steps runs no step statement
        done = complete(conn, [(e.lease, e.now, progress_text(e.outcome.progress)) for e in bare])
        done |= scans.succeeded(conn, batch, [(e.lease, e.now, e.outcome)
                                              for e in bare if e.lease.attempt_id not in done])
        results: list[State | TidepoolError] = []
        for (e, policy), f in zip(flat, fast, strict=True):
            if f and e.lease.attempt_id in done:
                results.append(State.COMPLETED)
                continue
            state, error = run_alone(conn, batch, functools.partial(finish_one, ending=e, policy=policy))
            results.append(state if error is None else error)
        answers = iter(results)
        return [([next(answers) for _ in op.endings], None) for op in ops]


def complete(conn: sqlite3.Connection, ends: list[tuple[Lease, float, str | None]]) -> set[str]:
    """Complete bare successes, each fenced at its own `now`, two statements per chunk (three when the fence
    refused some); the attempt ids completed. At most one ending per task."""
    done: set[str] = set()
    for chunk in chunks(ends):
        cur = conn.execute(Q["complete"].format(rows=values("complete_row", len(chunk))),
                           [x for lease, now, p in chunk for x in (*fence(lease), now, p)])
        if cur.rowcount != len(chunk):  # some were fenced off: the ones completed just now still have an open attempt
            completed = {r[0] for r in conn.execute(Q["completed_now"].format(marks=marks(len(chunk))),
                                                    [end[0].attempt_id for end in chunk])}
            chunk = [end for end in chunk if end[0].attempt_id in completed]
        if chunk:
            conn.execute(Q["attempts_succeeded"].format(rows=values("attempts_succeeded_row", len(chunk))),
                         [x for lease, now, _ in chunk for x in (lease.attempt_id, now)])
        done.update(lease.attempt_id for lease, _, _ in chunk)
    return done


def finish_one(conn: sqlite3.Connection, batch: Batch, *, ending: Ending, policy: RetryPolicy) -> State:
    """End one attempt the slow way: read its task behind the fence, decide, write."""
    lease, now = ending.lease, ending.now
    row = conn.execute(Q["ending"], fence(lease)).fetchone()
    if row is None or not may_end(State(row[0]), row[4], now):
        raise why_lost(conn, lease, now)
    return end(conn, lease, ending.outcome, row, now, policy, batch, step=row[5:7])


def end(conn: sqlite3.Connection, lease: Lease, outcome: Outcome, row: Any, now: float,
        policy: RetryPolicy, batch: Batch, *, step: Sequence[Any] = (None, None)) -> State:
    """Write how an attempt ended; `row` is (state, attempt, max_attempts, interruptions, ...). `step`: the
    task's (scan_id, scan_index), a scan step's scan moving on in this transaction when it ended for good."""
    scan_id = step[0]
    if scan_id is not None and outcome.status is AttemptStatus.SUCCEEDED:
        outcome = scans.checked(conn, scan_id, outcome)
    state, attempt, max_attempts, interruptions = State(row[0]), row[1], row[2], row[3]
    ended = decide_end(state, outcome, attempt=attempt, max_attempts=max_attempts, interruptions=interruptions,
                       policy=policy, now=now)
    error = error_text(ended.error)
    conn.execute(Q["end_attempt"], (ended.attempt_status, now, error, outcome.exit_status, outcome.stderr_tail,
                                    lease.attempt_id))
    queued = ended.available_at is not None
    uncount = 1 if ended.uncount_attempt else 0
    conn.execute(Q["end_task"], (ended.state, progress_text(outcome.progress), error, now, uncount, uncount,
                                 ended.available_at, None if queued else now, lease.task_id))
    if queued and batch.queued is not None:
        batch.queued += 1
    if scan_id is not None and ended.state.terminal:
        learned = outcome.scope if ended.state is State.COMPLETED else None
        scans.step_ended(conn, batch, scan_id=scan_id, index=step[1], task_id=lease.task_id, state=ended.state,
                         learned=learned, now=now)
    return ended.state
