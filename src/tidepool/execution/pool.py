"""The pool: baseline and demand workers, the busy counter, idle retirement, wake-ups.

Workers are long-lived coroutines: a task started per job costs ~60 µs in anyio, which alone would
cap the pool near 15,000 jobs a second. They sleep on a Waker until a submit, a retry promotion or
the safety-net poll wakes them. When a claim makes every live worker busy and the pool is below
max_workers, one demand worker starts at once; a demand worker that finds no work for idle_timeout_s
retires.

A claim serves every worker free to start a task now: the worker that makes it asks for as many tasks
as there are idle workers not spoken for (at most claim_batch), starts the first and leaves the rest in
the handoff for the idle workers it wakes, so a burst of work costs one claim transaction instead of one
per worker. Nothing is claimed ahead: a worker never holds a task it cannot start now.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup, TaskStatus

from ..errors import StoreUnavailable
from ..events import EventBus
from ..logs import Outage
from ..model import Claimed, ClaimFilter, Worker
from ..store.port import WorkerPort
from .engine import Engine
from .handoff import Handoff
from .leases import Held, LeaseKeeper
from .waker import Waker

if TYPE_CHECKING:
    from ..settings import PoolSettings

log = logging.getLogger("tidepool.pool")
LOOP_HELD_S = 2.0  # a supervisor tick this late says the event loop was held up (and by whom it may have been)


def _who_ran(ran: dict[str, str], *, named: int = 3) -> str:
    """Each plugin with how many tasks ran it and the first few of them, the rarest first: one short line."""
    by_plugin: dict[str, list[str]] = {}
    for task_id, plugin in ran.items():
        by_plugin.setdefault(plugin or "-", []).append(task_id)
    said = []
    for plugin, ids in sorted(by_plugin.items(), key=lambda kv: len(kv[1])):
        more = ", ..." if len(ids) > named else ""
        said.append(f"plugin {plugin}: {len(ids)} tasks ({', '.join(ids[:named])}{more})")
    return "; ".join(said) or "no task"


@dataclass(frozen=True)
class PoolStats:
    min_workers: int
    max_workers: int
    idle_timeout_s: float
    workers: int
    busy: int
    baseline: int
    demand: int
    claiming: bool


@dataclass
class PoolConfig:
    min_workers: int = 2
    max_workers: int = 16
    idle_timeout_s: float = 30.0
    poll_interval_s: float = 2.0
    claim_batch: int = 32  # the most one claim leases, for as many idle workers

    @classmethod
    def of(cls, section: PoolSettings) -> PoolConfig:
        return cls(section.min_workers, section.max_workers, section.idle_timeout_s, section.poll_interval_s,
                   section.claim_batch)


@dataclass(eq=False)
class _WorkerState:
    id: str
    kind: str  # "baseline" | "demand"
    busy: bool = False
    retire: bool = False


class Pool:
    def __init__(self, store: WorkerPort, engine: Engine, leases: LeaseKeeper, events: EventBus, *,
                 config: PoolConfig, node_id: str, instance_id: str, claim_filter: Callable[[], ClaimFilter],
                 promise_slots: Callable[[tuple[frozenset[str], ...]], AbstractContextManager[None]] = (
                     lambda _: contextlib.nullcontext()),
                 may_claim: Callable[[], bool] = lambda: True, waker: Waker | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._engine = engine
        self._leases = leases
        self._events = events
        self.config = config
        self._node_id = node_id
        self._instance_id = instance_id
        self._claim_filter = claim_filter
        self._promise_slots = promise_slots  # a claim in flight holds a slot of each tag set it asks for
        self._may_claim = may_claim
        self._clock = clock
        self._monotonic = monotonic
        self.waker = waker or Waker()  # whoever else wakes workers may hold it too: it is made first
        self.waker.max_permits = config.max_workers
        self._workers: dict[str, _WorkerState] = {}
        self._ids = itertools.count(1)
        self._busy = 0
        self._claiming = True
        self._store_outage = Outage(log)  # said once per outage, not once per worker and poll
        self._in_claim = 0
        self._claimed_for = 0  # workers the claims in flight may bring a task to, their claimers included
        self.handoff = Handoff(leases, engine.outcomes)  # what a claim leased for idle workers
        self._answered: anyio.Event | None = None  # set when a claim answers, if a worker it counted in waits
        self._awaiting_answer = 0  # workers waiting so: they take what a claim leaves before any sleeper
        self._tg: TaskGroup | None = None
        self._idle = anyio.Event()
        self.last_tick = monotonic()

    # supervision

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await tg.start(self._engine.outcomes.run)  # the workers' outcomes are written behind them
            self._reconcile_baseline("start")
            task_status.started()
            while True:  # the supervisor's tick: proof for the watchdog that the loop runs
                self.last_tick = self._monotonic()
                period_s = min(1.0, self.config.poll_interval_s)
                await anyio.sleep(period_s)
                self._engine.outcomes.completions.flush()  # the completions past the log's budget, once a second
                ran = self._engine.plugins_since_asked()
                # Late by this much, the loop was held at least as long (less the part of the sleep left then)
                if (late_s := self._monotonic() - self.last_tick - period_s) >= LOOP_HELD_S - period_s:
                    log.warning("the event loop was held up for at least %.1fs: no lease was renewed nor request "
                                "answered meanwhile. A plugin doing blocking work (time.sleep, a blocking library) "
                                "in its coroutine does this; ran then: %s", late_s, _who_ran(ran))

    def statistics(self) -> PoolStats:
        baseline = sum(1 for w in self._workers.values() if w.kind == "baseline")
        claiming = self._claiming and self._may_claim()  # not while draining, nor while a host guard holds it
        return PoolStats(self.config.min_workers, self.config.max_workers, self.config.idle_timeout_s,
                         len(self._workers), self._busy, baseline, len(self._workers) - baseline, claiming)

    def wake(self, n: int = 1) -> None:
        self.waker.wake(n)

    def configure(self, section: PoolSettings) -> bool:
        """A reload's pool settings: the poll interval and claim batch from the next claim on, the sizes as
        resize() applies them. Whether the sizes changed."""
        self.config.poll_interval_s = section.poll_interval_s
        self.config.claim_batch = section.claim_batch
        return self.resize(min_workers=section.min_workers, max_workers=section.max_workers,
                           idle_timeout_s=section.idle_timeout_s)

    def resize(self, *, min_workers: int | None = None, max_workers: int | None = None,
               idle_timeout_s: float | None = None) -> bool:
        """Change sizes live: grows at once, shrinks by retiring idle workers, never touches running tasks.
        False when nothing changed (and nothing was announced)."""
        c = self.config
        new_min = c.min_workers if min_workers is None else min_workers
        new_max = c.max_workers if max_workers is None else max_workers
        if new_max < new_min:
            raise ValueError(f"pool.max_workers ({new_max}) is below pool.min_workers ({new_min})")
        new_idle = c.idle_timeout_s if idle_timeout_s is None else idle_timeout_s
        if (new_min, new_max, new_idle) == (c.min_workers, c.max_workers, c.idle_timeout_s):
            return False
        c.min_workers, c.max_workers, c.idle_timeout_s = new_min, new_max, new_idle
        self.waker.max_permits = new_max
        self._reconcile_baseline("resize")
        self._give_back_unserved()
        self._events.publish("pool.resized", min_workers=new_min, max_workers=new_max,
                             idle_timeout_s=c.idle_timeout_s)
        self.waker.wake_all()  # so workers over the new sizes notice and retire
        return True

    def stop_claiming(self) -> None:
        self._claiming = False
        for worker in self._workers.values():
            worker.retire = True
        self.waker.wake_all()
        self.handoff.give_back_all()  # tasks left for idle workers go back now, not after the drain

    async def wait_idle(self) -> None:
        """Until no worker runs a task or waits for a claim (a claim in flight may still bring one), and
        every outcome is written."""
        while self._busy or self._in_claim:
            self._idle = anyio.Event()
            await self._idle.wait()
        await self._engine.outcomes.flushed()
        self._engine.outcomes.completions.flush(final=True)

    # workers

    def _reconcile_baseline(self, reason: str) -> None:
        workers = list(self._workers.values())
        baseline = [w for w in workers if w.kind == "baseline"]
        for worker in baseline[self.config.min_workers:]:
            worker.kind = "demand"  # over the new minimum: retires like a demand worker
        for worker in sorted(workers, key=lambda w: not w.busy)[self.config.max_workers:]:
            worker.retire = True  # idle ones first: they leave at once, a busy one only after its task
        demand = [w for w in workers if w.kind == "demand" and not w.retire]
        for _ in range(self.config.min_workers - len(baseline)):
            if demand:
                demand.pop().kind = "baseline"  # at max_workers already: keep one instead of adding one
            else:
                self._spawn("baseline", reason)

    def _spawn(self, kind: str, reason: str) -> None:
        """A new worker; `reason` says why: "start", "resize", or "busy" (a claim found every worker busy)."""
        if self._tg is None or not self._claiming or len(self._workers) >= self.config.max_workers:
            return
        worker = _WorkerState(f"{self._node_id}/w{next(self._ids)}", kind)
        self._workers[worker.id] = worker
        self._tg.start_soon(self._work, worker, name=worker.id)
        self._events.publish("worker.started", worker_id=worker.id, kind=kind, reason=reason)

    async def _work(self, worker: _WorkerState) -> None:
        reason = "stopped"
        identity = Worker(self._node_id, self._instance_id, worker.id)
        idle_since = self._monotonic()
        try:
            while self._claiming and not worker.retire:
                try:
                    started = self._take_from_handoff(worker)  # one a claim of another worker leased for it
                    if started is None and self._may_claim():
                        started = await self._claim(worker, identity)
                    if started is not None:
                        await self._execute(worker, *started)
                        idle_since = self._monotonic()
                        continue
                except Exception:  # a bug must not take the node down: log it, keep the worker
                    log.exception("worker %s: unexpected error; carrying on", worker.id)
                    await anyio.sleep(self.config.poll_interval_s)
                    continue
                idle_s = self._monotonic() - idle_since
                if worker.kind == "demand" and idle_s >= self.config.idle_timeout_s:
                    reason = "idle"
                    break
                await self.waker.wait(self._sleep_s(worker, idle_s))
            else:
                reason = "retired" if self._claiming else "shutdown"
        finally:
            del self._workers[worker.id]
            self._give_back_unserved()
            if self.handoff:  # a claim counted this worker in: another must start what it left
                self.waker.wake_workers(len(self.handoff))
            self._events.publish("worker.stopped", worker_id=worker.id, kind=worker.kind, reason=reason)

    def _sleep_s(self, worker: _WorkerState, idle_s: float) -> float:
        if worker.kind == "demand":
            return max(0.0, min(self.config.poll_interval_s, self.config.idle_timeout_s - idle_s))
        return self.config.poll_interval_s

    def _claim_limit(self, where: ClaimFilter) -> int:
        """How many tasks a claim may lease now: one for each worker free to start one (the claimer, and the
        idle workers no other claim or task in the handoff is meant for), at most claim_batch; 0 when a claim in
        flight already counts this worker in (it waits for what that claim leaves). A claim asking for free
        resource slots takes one: it cannot tell how many of its tasks one slot would serve."""
        free = self._staying_idle() - self._claimed_for - len(self.handoff)
        return min(1 if where.tag_sets else self.config.claim_batch, free)

    def _staying_idle(self) -> int:
        """Idle workers that will start a task: not the ones marked to retire."""
        return sum(1 for w in self._workers.values() if not (w.busy or w.retire))

    def _give_back_unserved(self, *, starting: int = 0) -> None:
        """Give back the tasks in the handoff beyond the idle workers left to take them (the rest retired or
        left since a claim counted them in): nobody would start them until a busy worker finished its task,
        and their leases would be renewed all that while. `starting`: idle workers about to start a task of
        their own claim, not one of the handoff's."""
        self.handoff.give_back_beyond(max(0, self._staying_idle() - starting - self._claimed_for))

    async def _claim(self, worker: _WorkerState, identity: Worker) -> tuple[Claimed, Held | None] | None:
        """Claim for every free worker: the first task for this one, the rest handed off to the others."""
        if self._engine.outcomes.unsent:
            # The outcomes just posted (this worker's among them) go to the store first, and the claim joins
            # them in the same write transaction: in a busy pool one commit instead of two per round of tasks.
            await anyio.lowlevel.checkpoint()
            if not self._claiming or worker.retire:
                return None
        where = self._claim_filter()
        limit = self._claim_limit(where)
        if limit <= 0 and not self._in_claim:
            # No claim to wait for: the tasks in the handoff that count this worker out are its to take (those
            # that ended while they waited are passed on the way, and no longer count).
            if (taken := self._take_from_handoff(worker)) is not None:
                return taken
            limit = self._claim_limit(where)
        if limit <= 0:
            if not self._in_claim:
                return None
            # Counted in by a claim in flight: wait for its answer, not in the waker, so that a wake coming
            # meanwhile (the claim may have looked before the work went in) finds no sleeper and is kept.
            # A poll interval at most: a claim stuck in the store must not hold this worker.
            self._awaiting_answer += 1
            try:
                with anyio.move_on_after(self.config.poll_interval_s):
                    await self._claim_answered()
            finally:
                self._awaiting_answer -= 1
            if worker.retire:  # resized down meanwhile: what that claim left goes to the workers staying
                return None
            return self._take_from_handoff(worker)
        self._in_claim += 1
        self._claimed_for += limit
        try:
            with self._promise_slots(where.tag_sets):  # until the engine takes its slot, in this same step
                claimed = await self._store.claim(identity, where, limit=limit, now=self._clock(),
                                                  lease_s=self._leases.lease_s)
        except StoreUnavailable as exc:
            self._store_outage.failing("workers cannot claim, retrying every %.1fs: %s",
                                       self.config.poll_interval_s, exc)
            await anyio.sleep(self.config.poll_interval_s)
            return None
        finally:
            self._in_claim -= 1
            self._claimed_for -= limit
            if self._answered is not None:
                self._answered.set()
                self._answered = None
            if not (self._busy or self._in_claim):
                self._idle.set()
        self._store_outage.over("workers claim again: the store answers")
        if not claimed:
            return None
        for c in claimed[1:]:
            self.handoff.put(c, identity.worker_id)
        if not self._claiming:  # a drain began during the claim: nothing of it starts
            self.handoff.put(claimed[0], identity.worker_id)
            self.handoff.give_back_all()
            return None
        self._give_back_unserved(starting=1)  # the workers it counted in may have retired or left meanwhile
        if len(claimed) - 1 > self._awaiting_answer:  # those are woken by the answer; the rest are asleep
            self.waker.wake_workers(len(claimed) - 1 - self._awaiting_answer)
        self._leased(claimed[0], identity.worker_id)
        return claimed[0], None

    async def _claim_answered(self) -> None:
        if self._answered is None:
            self._answered = anyio.Event()
        await self._answered.wait()

    def _take_from_handoff(self, worker: _WorkerState) -> tuple[Claimed, Held | None] | None:
        """A task another worker's claim leased for an idle worker, if one waits (and was not stopped meanwhile)."""
        taken = self.handoff.take()
        if taken is not None:
            self._leased(taken[0], worker.id)
        return taken

    def _leased(self, claimed: Claimed, worker_id: str) -> None:
        task = claimed.task
        self._events.publish("task.leased", task.id, worker_id, claimed.lease.attempt_id, task.attempt, task.type,
                             task.available_at)

    async def _execute(self, worker: _WorkerState, claimed: Claimed, held: Held | None) -> None:
        self._busy += 1
        worker.busy = True
        if self._busy >= len(self._workers) and len(self._workers) < self.config.max_workers:
            self._spawn("demand", "busy")
        try:
            await self._engine.run(claimed, worker.id, held=held)
        finally:
            self._busy -= 1
            worker.busy = False
            if not (self._busy or self._in_claim):
                self._idle.set()
