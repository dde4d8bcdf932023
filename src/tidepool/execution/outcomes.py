"""Outcomes: how each attempt ended, posted by its worker, written behind the workers, reported once the
store answered.

A worker posts its attempt's outcome and goes straight on to claim its next task, so the claim and
the outcome reach the store together instead of one round trip after the other. Outcomes that queue
while a write is in flight share the next one: one store call for many. Each write is fenced by its
lease, which is renewed until the write is answered, so trying it again while the store is briefly
away is safe, and no other node runs the task meanwhile. What the store answered is reported (events,
log lines) only once it is durable, and once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from ..backoff import Backoff
from ..errors import LeaseLost, StoreUnavailable, TidepoolError, ValueRefused
from ..events import EventBus
from ..lifecycle import RetryPolicy
from ..logs import Completions
from ..model import AttemptStatus, Outcome, State, Task, TaskError
from ..store.port import Ending, WorkerPort
from .leases import Held, LeaseKeeper

log = logging.getLogger("tidepool.outcomes")
said = logging.getLogger("tidepool.engine")  # how attempts ended is told under the name operators filter on
# Four tries again, 3.75 s of waits in all, then the outcome is given up on; the lease is renewed meanwhile
# (see Outcomes). The store does not retry a write itself: this is the one retry of an outcome.
RETRY = Backoff(first_s=0.25, cap_s=2.0, tries=4)
# An outcome the store refused a value of, written instead: the same output would be refused again, so the
# attempt is not tried again on its account.
VALUE_REFUSED = TaskError("value_refused", "the store refused a value of this attempt's outcome (see the "
                          "node's log); the attempt is recorded failed instead", retryable=False)


@dataclass(eq=False, slots=True)
class Posted:
    """One attempt's outcome, waiting to be written; `now` is when the attempt ended (the fence's time)."""

    task: Task
    held: Held
    outcome: Outcome
    worker_id: str
    now: float
    tries: int = 0
    retry_at: float = 0.0  # monotonic: not before this after a try the store did not answer
    refused: bool = False  # the store refused a value of its outcome: this is the failure written instead


class OutcomeWriter:
    """Writes the posted outcomes in batches, behind the workers, and hands each answer to `report`."""

    def __init__(self, store: WorkerPort, *, policy: Callable[[], RetryPolicy],
                 report: Callable[[Posted, State | TidepoolError], None],
                 retry: Backoff = RETRY) -> None:
        self._store = store
        self._policy = policy
        self._report = report
        self._retry = retry
        self._queue: list[Posted] = []     # ready to be written
        self._waiting: list[Posted] = []   # to be tried again at their retry_at
        self._flying: list[Posted] = []  # being written now
        self._given_up: list[Posted] = []  # interruptions the store never took (see unwritten)
        self._posted = anyio.Event()
        self._flushed = anyio.Event()
        self._flushed.set()

    def post(self, posted: Posted) -> None:
        self._queue.append(posted)
        if self._flushed.is_set():
            self._flushed = anyio.Event()
        self._posted.set()

    def unwritten(self) -> list[Posted]:
        """The outcomes posted and not written: still tried (in flight ones included), and the interruptions
        given up on (only a shutdown interrupts, and it keeps them for the next start)."""
        return self._given_up + self._waiting + self._queue + self._flying

    @property
    def unsent(self) -> bool:
        """Outcomes are posted that the next write will take, and none is being written: they go out as
        soon as this writer's task runs."""
        return bool(self._queue) and not self._flying

    @property
    def pending(self) -> int:
        """Outcomes posted and not yet answered by the store."""
        return len(self._queue) + len(self._waiting) + len(self._flying)

    async def flushed(self) -> None:
        """Until every outcome posted so far has been written (or given up on)."""
        while self.pending:
            await self._flushed.wait()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            now = anyio.current_time()
            due = [p for p in self._waiting if p.retry_at <= now]
            if not self._queue and not due:
                self._posted = anyio.Event()
                wait_s = min((p.retry_at for p in self._waiting), default=now + 3600.0) - now
                with anyio.move_on_after(wait_s):
                    await self._posted.wait()
                continue
            self._waiting = [p for p in self._waiting if p.retry_at > now]
            batch, self._queue = due + self._queue, []  # the retried first: they waited longest
            self._flying = batch
            try:
                self._waiting.extend(await self._write(batch))
            finally:
                self._flying = []
            if not self.pending:
                self._flushed.set()

    async def _write(self, batch: list[Posted]) -> list[Posted]:
        """Write a batch and report each answer; the outcomes to try again because the store was away."""
        endings = [Ending(p.held.lease, p.outcome, p.now, resent=p.tries > 0) for p in batch]
        try:
            answers: list[State | TidepoolError] = await self._store.finish_many(endings, policy=self._policy())
        except Exception as exc:  # the adapter failed as a whole: every outcome of the batch shares it
            answers = [self._failed_whole(batch, exc)] * len(batch)
        again = []
        for posted, answer in zip(batch, answers, strict=True):
            if isinstance(answer, ValueRefused) and not posted.refused:
                again.append(self._refused(posted, answer))
                continue
            delay_s = self._retry.delay(posted.tries) if isinstance(answer, StoreUnavailable) else None
            if delay_s is not None:
                posted.tries += 1
                posted.retry_at = anyio.current_time() + delay_s
                log.warning("task %s attempt %s: outcome not written yet, retrying in %.1fs: %s", posted.task.id,
                            posted.held.lease.attempt_id, delay_s, answer)
                again.append(posted)
                continue
            if isinstance(answer, StoreUnavailable) and posted.outcome.status is AttemptStatus.INTERRUPTED:
                self._given_up.append(posted)
            try:
                self._report(posted, answer)
            except Exception:  # a bug in reporting must not stop the writing of everyone's outcomes
                log.exception("task %s attempt %s: reporting its outcome failed", posted.task.id,
                              posted.held.lease.attempt_id)
        return again

    @staticmethod
    def _failed_whole(batch: list[Posted], exc: Exception) -> TidepoolError:
        if isinstance(exc, StoreUnavailable | ValueRefused):
            return exc
        log.exception("outcomes of %d tasks: finish_many failed", len(batch))
        return StoreUnavailable(f"finish_many failed: {exc}")

    def _refused(self, posted: Posted, refused: ValueRefused) -> Posted:
        """The store refused a value of this outcome: sent again as it is, it would be refused again until the
        lease ran out and the task ran once more. It is written at once as the attempt's failure, saying why,
        with nothing of what the plugin said: the refused value may be any of it, its exit status too."""
        log.error("task %s attempt %s: the store refused the outcome %s (%s); writing it as failed (%s) instead",
                  posted.task.id, posted.held.lease.attempt_id, posted.outcome.status, refused, VALUE_REFUSED.code)
        posted.outcome = Outcome(AttemptStatus.FAILED, VALUE_REFUSED)
        posted.refused = True
        posted.retry_at = 0.0
        return posted


class Outcomes(OutcomeWriter):
    """This node's outcomes: posted as each attempt ends, written by the writer, and each answer told in
    events and log lines (one line per completion up to a budget a second, the rest counted)."""

    def __init__(self, store: WorkerPort, leases: LeaseKeeper, events: EventBus, *,
                 policy: Callable[[], RetryPolicy], clock: Callable[[], float] = time.time) -> None:
        super().__init__(store, policy=policy, report=self._reported)
        self._leases = leases
        self._events = events
        self._clock = clock
        self.completions = Completions(said)

    def conclude(self, task: Task, held: Held, outcome: Outcome | None, worker_id: str) -> None:
        """Post the attempt's outcome; its lease is kept (and renewed) until the outcome is written. None: the
        lease is gone, and nothing of the attempt may be written."""
        if outcome is None:
            self._leases.release(held)
            said.warning("task %s attempt %s abandoned: lease lost, outcome not recorded", task.id,
                         held.lease.attempt_id)
            self._events.publish("task.lease_lost", task_id=task.id, worker_id=worker_id,
                                 attempt_id=held.lease.attempt_id, type=task.type)
            return
        self._leases.attempt_over(held)
        outcome.progress = held.progress
        self.post(Posted(task, held, outcome, worker_id, self._clock()))

    def _reported(self, posted: Posted, answer: State | TidepoolError) -> None:
        """The store's answer to a posted outcome: said in events and logs, once."""
        self._leases.release(posted.held)
        task, outcome, worker_id = posted.task, posted.outcome, posted.worker_id
        attempt_id = posted.held.lease.attempt_id
        if isinstance(answer, LeaseLost):
            said.warning("task %s attempt %s outcome %s rejected: %s", task.id, attempt_id, outcome.status, answer)
            self._events.publish("task.lease_lost", task_id=task.id, worker_id=worker_id, attempt_id=attempt_id,
                                 type=task.type)
            return
        if isinstance(answer, TidepoolError):  # the store stayed away, or refused the move: the lease will expire
            said.error("task %s attempt %s outcome %s not recorded: %s", task.id, attempt_id, outcome.status, answer)
            return
        error = None if outcome.error is None else outcome.error.to_json()
        if answer is State.RETRY_WAIT:
            self._events.publish("task.retry_scheduled", task_id=task.id, worker_id=worker_id, error=error,
                                 attempt=task.attempt, type=task.type)
            said.info("task %s attempt %s %s -> retry_wait (%s)", task.id, attempt_id, outcome.status,
                      outcome.error.message if outcome.error else "")
        elif answer.terminal:
            self._events.publish("task.finished", task.id, worker_id, answer.value, error, task.type)
            if answer is State.COMPLETED:
                self.completions.completed(task.id, attempt_id)  # one line each, up to a budget a second
            else:
                said.info("task %s attempt %s -> %s", task.id, attempt_id, answer.value)
        else:
            said.info("task %s attempt %s %s -> %s", task.id, attempt_id, outcome.status, answer.value)


class UnwrittenInterruptions:
    """Attempts a shutdown interrupted but could not record so (the store was away), kept in a file of the
    node's state dir until its next start writes them: left to expire, each would be charged as a crash
    and could fail a task that never failed (an interruption is not charged to the task's attempts)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def keep(self, attempt_ids: Iterable[str]) -> None:
        ids = sorted(attempt_ids)
        if not ids:
            return
        try:
            self.path.write_text(json.dumps({"interrupted": ids}))
        except OSError as exc:
            log.warning("cannot keep %d interrupted attempts for the next start in %s: %s", len(ids), self.path, exc)

    def read(self) -> frozenset[str]:
        """The kept attempt ids; forget() them once they are written."""
        try:
            return frozenset(json.loads(self.path.read_text())["interrupted"])
        except FileNotFoundError:
            return frozenset()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable %s, ignored: %s", self.path, exc)
            return frozenset()

    def forget(self) -> None:
        self.path.unlink(missing_ok=True)
