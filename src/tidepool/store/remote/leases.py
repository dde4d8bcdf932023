"""A remote worker's leases: the worker verbs over its gateway's /w1 routes (claims as acquires, renewals,
phase notes, results, endings), and which of its leases are still live here.

Claims are acquires. One claim at a time is parked at the gateway (a long poll it answers the moment
a task it may take exists); the others meanwhile ask without waiting, so however the pool shares its
claims among idle workers, one connection waits for work, not one per worker. Renewals, phase notes
and endings go out as the lease keeper and the outcome writer batch them, one request per batch.

Leases are timed on this host's monotonic clock, from when the acquire or renewal that granted them
was sent, with the gateway's lease_s: a clock that disagrees with the gateway's moves no deadline.
A lease past its end here is written to no more (the lease keeper has stopped its attempt before);
only the acknowledgement of a cancel still goes out, as the gateway takes it whatever the lease.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from ...errors import (
    Conflict,
    DeadlinePassed,
    InvalidRequest,
    LeaseLost,
    QuotaExceeded,
    StoreError,
    StoreUnavailable,
    TaskCancelling,
    TidepoolError,
    ValueRefused,
)
from ...lifecycle import RetryPolicy
from ...model import Claimed, ClaimFilter, Lease, Phase, ResultBatch, State, Worker, new_id, sha256_of
from ..port import Ending, PhaseNote
from .database import RECONNECT, REQUEST_TIMEOUT_S, Answer, Calls, Refusal, instant, log, task_of
from .workers import Standing

PARK_S = 25.0            # asked of the gateway, which holds an acquire at most its gateway.max_wait_s
RESULT_TIMEOUT_S = 30.0  # a result batch may be large
MAX_MESSAGE, MAX_STDERR_TAIL = 4000, 4096  # characters of an ending the gateway takes
MAX_ACQUIRE = 256        # the most tasks one acquire may ask for; a pool's claim_batch may be larger


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    """What the gateway's last acquire said: how long its leases last and how often to renew them."""

    lease_s: float = 30.0
    renew_after_s: float = 10.0


class HeldAttempt(Protocol):
    """An attempt the lease keeper holds, as the gateway's cancels and revoke reach it: its lease, and how
    to stop it (`why`: "cancel" or "lost")."""

    @property
    def lease(self) -> Lease: ...
    def stop(self, why: str) -> None: ...


class GatewayLeases:
    """The worker verbs of one remote worker, sent to its gateway, and the one claim parked there."""

    def __init__(self, url: str, calls: Calls, standing: Standing, *, monotonic: Callable[[], float],
                 clock: Callable[[], float]) -> None:
        self.url = url
        self._calls = calls
        self._standing = standing
        self._monotonic = monotonic
        self._clock = clock
        self.terms = LeaseTerms()
        self._on_terms: Callable[[LeaseTerms], None] = lambda terms: None
        self._live = LocalLeases(monotonic)
        self.wake: Callable[[int], None] = lambda n: None  # the pool's, from watch()
        self._held: Callable[[], Sequence[HeldAttempt]] = list  # the lease keeper's attempts, once attached
        self._on_revoked: Callable[[], None] = lambda: None
        self._parked = False
        self._park_scope: anyio.CancelScope | None = None
        self._stopping = False

    def attach(self, *, held: Callable[[], Sequence[HeldAttempt]], on_terms: Callable[[LeaseTerms], None],
               on_revoked: Callable[[], None]) -> None:
        self._held, self._on_terms, self._on_revoked = held, on_terms, on_revoked

    def stop_acquiring(self) -> None:
        """A drain: claim nothing more; a parked acquire comes back with what the gateway leased meanwhile."""
        self._stopping = True
        if self._park_scope is not None:
            self._park_scope.cancel()

    # claims

    async def claim(self, worker: Worker, where: ClaimFilter, *, limit: int, now: float,
                    lease_s: float) -> list[Claimed]:
        if self._stopping or not self._standing.may_acquire():
            return []
        if self._parked:  # another claim waits at the gateway already, and tries it again while it is away
            return [] if self._calls.gone else await self._acquire(where, limit, wait_s=0.0, request_id=new_id())
        self._parked = True
        try:
            claimed = await self._park(where, limit)
        finally:
            self._parked = False
        if claimed:
            self.wake(1)  # someone else parks while this worker runs what it got
        return claimed

    async def _park(self, where: ClaimFilter, limit: int) -> list[Claimed]:
        """An acquire the gateway holds until it has work, tried again with backoff while it is away (the same
        request_id while its leases may exist, so an answer lost in transit strands none)."""
        started = self._monotonic()
        request_id, asked_at = new_id(), started
        delays = RECONNECT.delays()
        try:
            with anyio.CancelScope() as self._park_scope:
                while True:
                    if self._monotonic() - asked_at >= self.terms.lease_s:
                        request_id, asked_at = new_id(), self._monotonic()
                    try:
                        return await self._acquire(where, limit, wait_s=PARK_S, request_id=request_id,
                                                   asked_at=asked_at)
                    except StoreUnavailable:
                        wait_s = next(delays)
                        if self._monotonic() + wait_s - started > PARK_S:
                            return []  # the pool's worker claims again after its poll, with a fresh filter
                        await anyio.sleep(wait_s)
        finally:
            self._park_scope = None
        try:  # stopped: what the gateway leased to the cut-short request comes back, to be given back
            return await self._acquire(where, limit, wait_s=0.0, request_id=request_id, asked_at=asked_at)
        except StoreUnavailable:
            return []

    async def _acquire(self, where: ClaimFilter, limit: int, *, wait_s: float, request_id: str,
                       asked_at: float | None = None) -> list[Claimed]:
        sent = self._monotonic() if asked_at is None else asked_at  # a repeat's leases may date from the first
        body = {"types": list(where.types) if where.types is not None else ["*"],
                "slots": [sorted(tags) for tags in where.tag_sets], "max": min(limit, MAX_ACQUIRE), "wait_s": wait_s,
                "request_id": request_id}
        try:
            answer = self._calls.ok(await self._calls.post("/w1/acquire", body, timeout_s=wait_s + REQUEST_TIMEOUT_S))
        except Refusal as exc:
            self._standing.refused(exc)
            return []
        received, received_clock = self._monotonic(), self._clock()
        with self._calls.reading("/w1/acquire"):
            data = answer.body
            self._learn(LeaseTerms(float(data["lease_s"]), float(data["renew_after_s"])))
            self._standing.heard(str(data.get("worker_state", "enabled")))
            claimed = []
            for item in data["tasks"]:
                task = task_of(item["task"])
                until = self._lease_end(instant(item["lease_expires_at"]), sent=sent, received=received,
                                        received_clock=received_clock)
                lease = Lease(task.id, item["attempt_id"], item["lease_token"], received_clock + until - received)
                self._live.granted(lease.attempt_id, until)
                claimed.append(Claimed(task, lease))
            cancels = [str(a) for a in data.get("cancel") or ()]
        for attempt_id in cancels:  # as a renewal's status cancel: its control stream may be down
            if not self._live.is_cancelling(attempt_id):  # each answer names it until it has ended
                self.cancel(attempt_id)
        return claimed

    def _lease_end(self, expires_at: float, *, sent: float, received: float, received_clock: float) -> float:
        """When a lease granted to an acquire ends, on this host's monotonic clock. It was granted between
        the request's sending and the answer's receipt (a parked acquire waits long in between): the
        gateway's expiry time places it there when the two clocks agree, and one clock far off the other
        cannot move it out of that span."""
        by_clock = received + (expires_at - received_clock)
        return min(max(by_clock, sent + self.terms.lease_s), received + self.terms.lease_s)

    def _learn(self, terms: LeaseTerms) -> None:
        if terms != self.terms and 0 < 2 * terms.renew_after_s <= terms.lease_s:
            log.info("gateway %s leases for %gs, renewed every %gs", self.url, terms.lease_s, terms.renew_after_s)
            self.terms = terms
            self._on_terms(terms)

    # the lease keeper's writes

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        live, lost = self._live.split(leases)
        if not live:
            return lost
        sent = self._monotonic()
        body = {"leases": [{"attempt_id": x.attempt_id, "lease_token": x.token} for x in live]}
        try:
            answer = await self._calls.post_within("/w1/renew", body, budget_s=self.terms.renew_after_s)
        except Refusal as exc:
            return lost | self._refused(live, exc)
        with self._calls.reading("/w1/renew"):
            answered = {item["attempt_id"]: item for item in answer.body["leases"]}
            for lease in live:
                item = answered.get(lease.attempt_id, {"status": "lost", "reason": "not in the gateway's answer"})
                if item["status"] == "held":
                    self._live.granted(lease.attempt_id, sent + self.terms.lease_s)
                elif item["status"] == "cancel":
                    self._live.cancelling(lease.attempt_id)
                    lost[lease.attempt_id] = TaskCancelling(lease.task_id, lease.attempt_id)
                else:
                    lost[lease.attempt_id] = self._live.lost(lease, item.get("reason"))
            self._standing.heard(str(answer.body.get("worker_state", self._standing.state)))
        return lost

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        live_leases, lost = self._live.split([n.lease for n in notes])
        live = [n for n in notes if n.lease.attempt_id not in lost]
        if not live:
            return lost
        body = {"notes": [{"attempt_id": n.lease.attempt_id, "lease_token": n.lease.token, "phase": n.phase.value,
                           **({"progress": n.progress} if n.progress is not None else {})} for n in live]}
        timeout_s = min(REQUEST_TIMEOUT_S, max(1.0, self.terms.renew_after_s / 2))  # renewals wait behind it
        try:
            answer = self._calls.written(await self._calls.post("/w1/phase", body, timeout_s=timeout_s))
        except Refusal as exc:
            return lost | self._refused(live_leases, exc)
        with self._calls.reading("/w1/phase"):
            gone = set(answer.body["lost"])
        return lost | {x.attempt_id: self._live.lost(x, None) for x in live_leases if x.attempt_id in gone}

    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float) -> ResultBatch:
        if not self._live.alive(lease.attempt_id):
            raise ended_here(lease)
        body = {"attempt_id": lease.attempt_id, "lease_token": lease.token, "plugin": batch.plugin,
                "sequence": batch.sequence, "idempotency_key": batch.idempotency_key,
                "sha256": sha256_of(batch.payload), "final": batch.final, "payload": batch.payload}
        try:
            answer = await self._calls.post("/w1/results", body, timeout_s=RESULT_TIMEOUT_S)
        except Refusal as exc:
            raise self._refused([lease], exc)[lease.attempt_id] from None
        if answer.status in (200, 201):
            return ResultBatch(batch.plugin, batch.sequence, batch.idempotency_key, body["sha256"], batch.final,
                               batch.payload, lease.attempt_id, stored_now=answer.status == 201)
        if answer.status == 409:
            raise Conflict(f"result key {batch.idempotency_key}: {answer.error_message()}")
        if answer.status == 410:
            raise self._live.lost(lease, _reason(answer))
        if answer.status == 413:  # the attempt's result quota: nothing stored, and sending it again would not be
            raise QuotaExceeded(answer.error_code() or "result_quota", answer.error_message())
        raise InvalidRequest("result", f"the gateway refused it ({answer.status}): {answer.error_message()}")

    # the outcome writer's endings

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        """The gateway applies its own retry policy; `policy` and each ending's `now` are its to decide."""
        answers: dict[str, State | TidepoolError] = {}
        live = []
        for e in endings:
            if self._live.alive(e.lease.attempt_id):
                live.append(e)
            else:
                answers[e.lease.attempt_id] = ended_here(e.lease)
        if live:
            await self._last_progress(live)
            answers |= await self._finish(live)
        for e in endings:
            if not isinstance(answers[e.lease.attempt_id], StoreUnavailable | ValueRefused):  # to be sent again
                self._live.forget(e.lease.attempt_id)
        return [answers[e.lease.attempt_id] for e in endings]

    async def _last_progress(self, endings: list[Ending]) -> None:
        """The attempts' last progress reports, which an ending does not carry: written first, as phase notes,
        so that a finished task shows where its plugins got to (a failure here costs only that)."""
        notes = [PhaseNote(e.lease, Phase.STOP, e.outcome.progress) for e in endings if e.outcome.progress is not None]
        if notes:
            with contextlib.suppress(StoreError):
                await self.set_phase(notes, now=self._clock())

    async def _finish(self, endings: list[Ending]) -> dict[str, State | TidepoolError]:
        """Tried again while the gateway is away (a restart outlasts the outcome writer's few tries), for as long
        as every lease of the batch lasts here: each try is fenced, and past that no ending may go out."""
        body = {"endings": [_ending(e) for e in endings]}
        budget_s = min(self.terms.lease_s, *(self._live.time_left(e.lease.attempt_id) for e in endings))
        try:
            answer = await self._calls.post_within("/w1/finish", body, budget_s=budget_s)
        except Refusal as exc:
            return dict(self._refused([e.lease for e in endings], exc))
        except StoreError as exc:
            unavailable = exc if isinstance(exc, StoreUnavailable | ValueRefused) else StoreUnavailable(str(exc))
            return {e.lease.attempt_id: unavailable for e in endings}
        try:
            with self._calls.reading("/w1/finish"):
                answered = {item["attempt_id"]: item for item in answer.body["endings"]}
        except StoreUnavailable as exc:
            return {e.lease.attempt_id: exc for e in endings}
        result: dict[str, State | TidepoolError] = {}
        for e in endings:
            item = answered.get(e.lease.attempt_id, {"lost": "not in the gateway's answer"})
            result[e.lease.attempt_id] = _answer_of(item, e.lease, self._live)
        return result

    # the gateway's cancels and revoke

    def cancel(self, attempt_id: str) -> None:
        for held in self._held():
            if held.lease.attempt_id == attempt_id:
                log.info("task %s attempt %s: the gateway asks to cancel it; stopping", held.lease.task_id,
                         attempt_id)
                self._live.cancelling(attempt_id)
                held.stop("cancel")

    def revoked(self) -> None:
        """Revoked: every attempt stops now and writes nothing (the gateway refuses it, and cancels them)."""
        for held in self._held():
            held.stop("lost")
        self._on_revoked()
        if self._park_scope is not None:
            self._park_scope.cancel()

    def _refused(self, leases: Sequence[Lease], exc: Refusal) -> dict[str, LeaseLost]:
        self._standing.refused(exc)
        return {x.attempt_id: self._live.lost(x, exc.code) for x in leases}

    # for the blobs' calls (blobs.py), fenced by the same leases

    def time_left(self, lease: Lease) -> float:
        """Seconds the lease lasts here; 0 or less once nothing more may be sent for it."""
        return self._live.time_left(lease.attempt_id) if self._live.alive(lease.attempt_id) else 0.0

    def lost(self, lease: Lease, answer: Answer) -> LeaseLost:
        """The gateway's 410 for this lease, as the other writes take it."""
        return self._live.lost(lease, _reason(answer))

    def refused(self, lease: Lease, exc: Refusal) -> LeaseLost:
        """The registry's refusal of this worker, as the other writes take it."""
        return self._refused([lease], exc)[lease.attempt_id]


def _ending(e: Ending) -> dict[str, Any]:
    ending: dict[str, Any] = {"attempt_id": e.lease.attempt_id, "lease_token": e.lease.token,
                              "status": e.outcome.status.value}
    if e.outcome.error is not None:
        ending["error"] = {"code": e.outcome.error.code, "message": e.outcome.error.message[-MAX_MESSAGE:]}
        ending["retryable"] = e.outcome.error.retryable
    if e.outcome.exit_status is not None:
        ending["exit_status"] = e.outcome.exit_status
    if e.outcome.stderr_tail is not None:
        ending["stderr_tail"] = e.outcome.stderr_tail[-MAX_STDERR_TAIL:]
    if e.outcome.scope:  # the engine gives one with a success only; an empty one merges nothing
        ending["scope"] = e.outcome.scope
    return ending


def _answer_of(item: dict[str, Any], lease: Lease, live: LocalLeases) -> State | TidepoolError:
    """One ending as the gateway answered it: the task's state, the value its store refused, or the lease lost."""
    if item.get("state"):
        return State(item["state"])
    error = item.get("error")
    if isinstance(error, dict) and error.get("code") == ValueRefused.code:
        return ValueRefused(f"task {lease.task_id} attempt {lease.attempt_id}: the gateway's store refused a value "
                            f"of its ending: {error.get('message', '')}")
    return live.lost(lease, item.get("lost"))


def _reason(answer: Answer) -> str | None:
    reason = answer.body.get("error", {}).get("reason") if isinstance(answer.body, dict) else None
    if reason is None and isinstance(answer.body, dict):
        reason = answer.body.get("reason")
    return str(reason) if reason is not None else None


class LocalLeases:
    """Which leases are still live here: each one's end on this host's monotonic clock, and the attempts the
    gateway asked to stop. A write for a lease past its end is not sent: the worker writes nothing more for
    an attempt it could not renew in time (another worker may run it by now)."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._until: dict[str, float] = {}  # attempt id -> monotonic end of its lease as known here
        self._cancelling: set[str] = set()  # the gateway asked to stop these: their cancel may still be written

    def granted(self, attempt_id: str, until: float) -> None:
        """Granted or renewed, to end at monotonic `until`."""
        self._until[attempt_id] = until

    def cancelling(self, attempt_id: str) -> None:
        """The gateway takes this attempt's cancel whatever its lease: its ending may go out after the end."""
        self._cancelling.add(attempt_id)

    def is_cancelling(self, attempt_id: str) -> bool:
        return attempt_id in self._cancelling

    def alive(self, attempt_id: str) -> bool:
        until = self._until.get(attempt_id)
        return attempt_id in self._cancelling or (until is not None and self._monotonic() < until)

    def time_left(self, attempt_id: str) -> float:
        """Seconds until the lease ends here; unbounded for a cancel's attempt, whose ending is taken anyway."""
        if attempt_id in self._cancelling:
            return float("inf")
        return self._until.get(attempt_id, 0.0) - self._monotonic()

    def split(self, leases: Sequence[Lease]) -> tuple[list[Lease], dict[str, LeaseLost]]:
        """The leases still live here, and the others as lost (nothing is to be sent for them)."""
        live = [x for x in leases if self.alive(x.attempt_id)]
        return live, {x.attempt_id: ended_here(x) for x in leases if not self.alive(x.attempt_id)}

    def lost(self, lease: Lease, reason: str | None) -> LeaseLost:
        """The gateway says the lease is gone, and why: a cancel's attempt may still say it stopped."""
        if reason == "cancelled":
            self.cancelling(lease.attempt_id)
            return TaskCancelling(lease.task_id, lease.attempt_id)
        self.forget(lease.attempt_id)
        if reason == DeadlinePassed.reason:
            return DeadlinePassed(lease.task_id, lease.attempt_id)
        return LeaseLost(lease.task_id, lease.attempt_id, f"the gateway says the lease is lost ({reason or 'lost'})")

    def forget(self, attempt_id: str) -> None:
        self._until.pop(attempt_id, None)
        self._cancelling.discard(attempt_id)


def ended_here(lease: Lease) -> LeaseLost:
    return LeaseLost(lease.task_id, lease.attempt_id, "lease ended here before a renewal got through; nothing "
                                                       "more is written for it")
