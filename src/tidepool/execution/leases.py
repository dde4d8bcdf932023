"""The lease keeper: this node's live leases, renewed together, their phase notes written behind, each given
up (its attempt stopped) once it cannot be renewed in time.

Renewal runs here, off the tasks' own code path, so a busy plugin cannot starve it; one write renews
every lease of the node. "In time" is judged on this node's monotonic clock by a watch no write can
hold up (a store may accept a connection and never answer), a margin before the store would expire the
lease (a quarter of it, less when renewals need the time): the plugin needs that long to stop before
another node may take the task. The margin is fixed when a lease is granted or renewed, so a reload that
lengthens leases makes none granted before it look overdue.

The fence: once `heard()` told of a saved heartbeat, every attempt is stopped when none has been saved
for `fence_after_s`, one heartbeat before the fleet would call the node gone and expire its attempts;
unless the last look at the fleet found no other live node, which alone could take the tasks over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
from anyio.abc import TaskStatus

from ..backoff import Backoff
from ..errors import LeaseLost, StoreUnavailable, TaskCancelling, ValueRefused
from ..logs import Outage
from ..model import Lease, Phase
from ..store.port import PhaseNote, WorkerPort

log = logging.getLogger("tidepool.leases")
T = TypeVar("T")
STORE_RETRY = Backoff(0.1, 1.0)  # between tries of an attempt's store call while the store does not answer
GIVE_UP_SHARE = 0.25  # of lease_s: a lease is given up up to this long before the store would expire it


@dataclass(eq=False)
class Held:
    """One attempt this node is executing; `why` says why its scope was cancelled."""

    lease: Lease
    scope: anyio.CancelScope
    deadline: float                       # monotonic: when the store would expire the lease, unless renewed
    margin_s: float = 0.0                 # given up this long before the deadline (see the module docstring)
    why: str | None = None                # "cancel", "lost", "interrupt", "fenced"
    phase: Phase | None = None            # the latest phase and progress, written behind
    progress: dict[str, object] | None = None
    deadline_s: float | None = None       # from its run phase on: how long the store lets it live (PhaseNote)
    # Called when stopped before its attempt started (a task in the handoff): no scope is entered yet
    # to cancel, so whoever holds the task must end it now rather than at its turn.
    waiting: Callable[[Held], None] | None = None

    async def asking(self, call: Callable[[], Awaitable[T]]) -> T:
        """call() until the store answers it: one that does not answer is asked again for as long as this lease
        is held (an outage costs the attempt a wait, never its run; the fence keeps a try again safe). Once the
        lease keeper gives the lease up it cancels the attempt, this wait included."""
        for wait in STORE_RETRY.delays():
            try:
                return await call()
            except StoreUnavailable:
                if self.why is not None:
                    raise
            await anyio.sleep(wait)
        raise AssertionError("STORE_RETRY has no end")

    def stop(self, why: str) -> None:
        if self.why is None:
            self.why = why
        self.scope.cancel()
        if self.waiting is not None:
            self.waiting(self)


class LeaseKeeper:
    def __init__(self, store: WorkerPort, *, lease_s: float, renew_every_s: float, flush_every_s: float = 0.1,
                 fence_after_s: float | None = None, on_fence: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._fence_after_s = fence_after_s
        self._on_fence = on_fence  # told before the fence stops the attempts: their commands must die quickly
        self._heard_at: float | None = None  # monotonic: when the last saved heartbeat started
        self._others_alive = True  # until a look at the fleet says otherwise, someone may take over
        self.lease_s = lease_s
        self.renew_every_s = renew_every_s
        self._flush_every_s = flush_every_s
        self._clock = clock
        self._monotonic = monotonic
        self._held: dict[str, Held] = {}
        self._dirty: set[str] = set()
        self._busy = anyio.Event()
        self._watched = anyio.Event()  # the deadline watch's own wake-up: a lease is held
        # writes the store did not take, by kind: said once an outage, not 10 times a second
        self._outages = {what: Outage(log) for what in ("renewal", "phase")}

    def configure(self, *, lease_s: float, renew_every_s: float) -> None:
        self.lease_s, self.renew_every_s = lease_s, renew_every_s

    def heard(self, started: float) -> None:
        """A heartbeat that started at monotonic `started` was saved: the fleet knows this node is alive."""
        self._heard_at = started if self._heard_at is None else max(self._heard_at, started)

    def fleet_seen(self, others_alive: bool) -> None:
        """Whether the last look at the fleet found another live node: none, none can take a task over."""
        self._others_alive = others_alive

    def hold(self, lease: Lease) -> Held:
        remaining = lease.expires_at - self._clock()
        held = Held(lease, anyio.CancelScope(), self._monotonic() + remaining, self._margin_s())
        self._held[lease.attempt_id] = held
        self._busy.set()
        self._watched.set()
        return held

    def release(self, held: Held) -> None:
        self._held.pop(held.lease.attempt_id, None)
        self._dirty.discard(held.lease.attempt_id)

    def attempt_over(self, held: Held) -> None:
        """The attempt has ended: its phase notes are moot, but the lease is renewed on until its outcome
        is written (release), so a slow write cannot let another node run the task again meanwhile."""
        self._dirty.discard(held.lease.attempt_id)

    def note(self, held: Held, phase: Phase, progress: dict[str, object] | None = None) -> None:
        """Record a phase or progress change; written with the next flush unless the task ends first."""
        held.phase = phase
        if progress is not None:
            held.progress = progress
        self._dirty.add(held.lease.attempt_id)

    def time_left(self, held: Held) -> float:
        """Seconds until the lease is given up unless a renewal gets through first."""
        return held.deadline - held.margin_s - self._monotonic()

    def _margin_s(self) -> float:
        """How long before the store's expiry a lease granted or renewed now is given up: a quarter of the
        lease, less if renewals need the time (two renewal intervals must fit before it)."""
        return max(0.0, min(self.lease_s * GIVE_UP_SHARE, self.lease_s - 2 * self.renew_every_s))

    def held(self) -> list[Held]:
        return list(self._held.values())

    def find(self, task_id: str) -> Held | None:
        return next((h for h in self._held.values() if h.lease.task_id == task_id), None)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_deadlines)
            task_status.started()
            await self._write()

    async def _watch_deadlines(self) -> None:
        while True:
            if not self._held:  # idle: no tick
                self._watched = anyio.Event()
                await self._watched.wait()
            await anyio.sleep(self._flush_every_s)
            self._give_up_overdue()

    async def _write(self) -> None:
        """Phase notes every flush_every_s, renewals every renew_every_s, for as long as leases are held."""
        next_renewal = self._monotonic() + self.renew_every_s
        while True:
            if not self._held:  # an idle node sleeps here instead of ticking (idle CPU ~0)
                self._busy = anyio.Event()
                await self._busy.wait()
                next_renewal = self._monotonic() + self.renew_every_s
            await anyio.sleep(self._flush_every_s)
            await self.flush()
            if self._monotonic() >= next_renewal:
                next_renewal = self._monotonic() + self.renew_every_s
                await self.renew()

    async def flush(self) -> None:
        notes = [PhaseNote(h.lease, h.phase, h.progress, h.deadline_s) for a in self._dirty
                 if (h := self._held.get(a)) is not None and h.phase is not None]
        self._dirty.clear()
        if notes and await self._apply(self._store.set_phase(notes, now=self._clock()), "phase",
                                       tasks=[n.lease.task_id for n in notes]) is None:
            self._dirty.update(n.lease.attempt_id for n in notes)  # not written: try with the next flush

    async def renew(self) -> None:
        # A lease found lost cannot come back: its attempt is being stopped, and renewing it again would
        # only be refused again (and said again) until the plugin lets go.
        held = [h for h in self._held.values() if h.why != "lost"]
        if not held:
            return
        started = self._monotonic()
        lost = await self._apply(self._store.renew([h.lease for h in held], now=self._clock(),
                                                   lease_s=self.lease_s), "renewal",
                                 tasks=[h.lease.task_id for h in held])
        if lost is not None:
            for h in held:
                if h.lease.attempt_id not in lost:
                    h.deadline, h.margin_s = started + self.lease_s, self._margin_s()

    async def _apply(self, write: object, what: str, *, tasks: list[str]) -> dict[str, LeaseLost] | None:
        """The leases a write found lost; None when it is to be tried again. A value the store refused would be
        refused again: that write ends here, said once, and is not tried again (phase notes are dropped; a
        renewal goes on at its next turn, as any)."""
        try:
            lost: dict[str, LeaseLost] = await write  # type: ignore[misc]
        except ValueRefused as exc:
            log.error("tasks %s: lease %s write refused by the store, not tried again: %s", ", ".join(tasks[:5]),
                      what, exc)
            return {} if what == "phase" else None
        except StoreUnavailable as exc:
            self._outages[what].failing("lease %s writes fail, retrying until the store answers: %s", what, exc)
            return None
        self._outages[what].over("lease %s writes go through again", what)
        for attempt_id, reason in lost.items():
            held = self._held.get(attempt_id)
            if held is not None:
                why = "cancel" if isinstance(reason, TaskCancelling) else "lost"
                if why == "lost":
                    log.warning("task %s attempt %s lease lost: %s", held.lease.task_id, attempt_id, reason)
                held.stop(why)
        return lost

    def _give_up_overdue(self) -> None:
        if self._fenced():
            return
        for held in list(self._held.values()):
            if self.time_left(held) <= 0 and held.why is None:
                log.warning("task %s attempt %s lease not renewed in time; stopping the attempt",
                            held.lease.task_id, held.lease.attempt_id)
                held.stop("lost")

    def fencing(self) -> bool:
        """Whether the fleet may be about to call this node gone: no claim then, for its attempt would be
        stopped at once and its task left leased to a live node until the lease ran out."""
        return self._unheard_s() is not None

    def _unheard_s(self) -> float | None:
        """How long no heartbeat of this node was saved, once that is long enough to fence it; else None."""
        if self._fence_after_s is None or self._heard_at is None or not self._others_alive:
            return None
        unheard_s = self._monotonic() - self._heard_at
        return unheard_s if unheard_s >= self._fence_after_s else None

    def _fenced(self) -> bool:
        """Stop every attempt if the fleet may be about to call this node gone; True if it did."""
        unheard_s = self._unheard_s()
        if unheard_s is None:
            return False
        running = [held for held in self._held.values() if held.why is None]
        if running:
            self._on_fence()  # first: the kills the stops start must already be hurried
        for held in running:
            log.warning("task %s attempt %s stopped: no heartbeat of this node saved for %.1fs, so the fleet "
                        "will soon call it gone and run the task elsewhere", held.lease.task_id,
                        held.lease.attempt_id, unheard_s)
            held.stop("fenced")
        return True
