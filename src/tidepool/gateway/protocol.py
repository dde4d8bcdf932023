"""The worker protocol's verbs as the gateway serves them: acquire (held until a task it may take exists),
renew, phase notes, results and endings, each for the identity its certificate names, never for another's.

Every write is fenced by the store on task, attempt and token; the gateway adds the caller: an attempt whose
owner (its node_id, fixed when the attempt was made) is not the caller is refused as a lease it does not hold,
without telling whose it is. The owner never changes, so reading it before the fenced write cannot race.
The gateway publishes the events of the attempts (events.py), so the node's event stream and dashboard show
the remote work as well.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from ..errors import (
    Conflict,
    DeadlinePassed,
    InvalidRequest,
    LeaseGone,
    LeaseLost,
    QuotaExceeded,
    StoreUnavailable,
    TaskCancelling,
    TaskNotFound,
    TidepoolError,
    ValueRefused,
)
from ..events import EventBus
from ..http.answers import TaskDetailOut
from ..lifecycle import RetryPolicy
from ..metrics.gateway import GatewayMetrics
from ..model import (
    AttemptStatus,
    CertSeen,
    Claimed,
    ClaimFilter,
    Lease,
    Outcome,
    Phase,
    RemoteWorker,
    ResultBatch,
    State,
    TaskError,
    WorkerState,
    rfc3339,
    sha256_of,
)
from ..settings import ArtifactSettings, GatewaySettings, LeaseSettings
from ..store import Acquired, Ending, PhaseNote, Store
from ..store.bounds import RunDeadline
from ..store.port import ResultQuota
from .attempts import RemoteAttempts, lease_of, worker_token
from .control import Controls
from .events import AttemptEvents
from .parking import EmptyAnswers, Parking
from .registry import WorkerRegistry
from .replays import Replays
from .schemas import AcquireIn, EndingIn, LeaseIn, NoteIn, ResultIn
from .tls import Peer

log = logging.getLogger("tidepool.gateway")
GONE_BEFORE_ANSWER = TaskError("interrupted", "the worker went away before its acquire was answered")
NOT_YOURS = "superseded"  # the reason given for an attempt the caller does not own: it holds no lease on it


class Gateway:
    def __init__(self, store: Store, events: EventBus, *, settings: GatewaySettings, lease: LeaseSettings,
                 policy: Callable[[], RetryPolicy], max_body_kb: int = 1024,
                 clock: Callable[[], float] = time.time, deadline: RunDeadline | None = None,
                 artifacts: ArtifactSettings | None = None) -> None:
        self.store = store
        self.artifacts = artifacts or ArtifactSettings()  # what one attempt may upload (files.py)
        self.events = events
        self.settings = settings
        self.lease = lease
        # the run deadline of remote attempts, from this node's task types: never from what a worker says
        self.deadline = deadline or RunDeadline(600.0, 30.0, lease.duration_s)
        self._policy = policy
        self.max_body_kb = max_body_kb
        self._clock = clock
        self.parking = Parking()
        self.empty = EmptyAnswers()
        self.controls = Controls(parked=self.parking.identities)
        self.attempts = RemoteAttempts()
        self.reports = AttemptEvents(events, self.attempts, store)
        self.replays = Replays()
        self.metrics = GatewayMetrics(held=lambda: len(self.parking), streams=self.controls.open_streams)
        self.registry = WorkerRegistry(store, events, self.controls, self.parking, self.metrics, clock=clock)

    def configure(self, settings: GatewaySettings, lease: LeaseSettings, deadline: RunDeadline | None = None,
                  artifacts: ArtifactSettings | None = None) -> None:
        self.settings, self.lease = settings, lease
        self.artifacts = artifacts or self.artifacts
        self.deadline = deadline or self.deadline

    def now(self) -> float:
        """The gateway's clock: what its writes are judged at."""
        return self._clock()

    def wake(self, n: int = 1) -> None:
        """n tasks became claimable: parked acquires first, then the control streams of the others."""
        self.parking.wake(n)
        self.controls.wake(n)

    async def meet(self, peer: Peer, *, version: str | None = None) -> RemoteWorker:
        return await self.registry.meet(peer, cert=CertSeen(peer.fingerprint, peer.not_after, peer.issuer),
                                        enroll=self.settings.enroll,
                                        max_concurrent_tasks=self.settings.max_concurrent_tasks,
                                        version=version, min_version=self.settings.min_worker_version)

    # acquire

    async def acquire(self, worker: RemoteWorker, body: AcquireIn, *, version: str | None,
                      gone: Callable[[], bool], on_gone: Callable[[Callable[[], None]], Callable[[], None]],
                      ) -> dict[str, Any]:
        """Lease up to body.max tasks, held up to min(wait_s, gateway.max_wait_s) until one exists. A request_id
        sent again within lease_s answers what the first one leased. The answer names the caller's attempts in
        cancelling, as a renewal does, for a worker whose control stream is down."""
        answer = await self._leases_for(worker, body, version=version, gone=gone, on_gone=on_gone)
        return {**answer, "cancel": await self._cancelling(worker.id)}

    async def _cancelling(self, identity: str) -> list[str]:
        """Its attempts a cancel moved to cancelling; none said when the store is away (the answer may hold
        leases, which must not be lost for this: the next call tells them)."""
        try:
            return await self.store.cancelling_of(identity)
        except StoreUnavailable:
            return []

    async def _leases_for(self, worker: RemoteWorker, body: AcquireIn, *, version: str | None,
                          gone: Callable[[], bool], on_gone: Callable[[Callable[[], None]], Callable[[], None]],
                          ) -> dict[str, Any]:
        if worker.state is WorkerState.DISABLED:  # a drain: at once, nothing new
            self.metrics.answered.inc(("disabled",))
            return self._answer([], worker.state)
        if body.request_id is None:
            return await self._acquire(worker, body, version=version, gone=gone, on_gone=on_gone)
        replay = self.replays.find(worker.id, body.request_id, now=self._clock())
        if replay is not None:
            replay.supersede()  # the first one's client is gone, or it would not ask again: its hold ends
            await replay.done.wait()
            if replay.answer is not None and replay.answer["tasks"]:
                return dict(replay.answer)  # else it leased nothing: this one holds afresh
        replay = self.replays.start(worker.id, body.request_id)
        try:
            answer = await self._acquire(worker, body, version=version, gone=gone, on_gone=replay.also(on_gone),
                                         superseded=replay.superseded.is_set, keep=True)
        except BaseException:
            self.replays.forget(worker.id, body.request_id, replay)
            raise
        self.replays.answered(replay, answer, keep_until=self._clock() + self.lease.duration_s)
        return answer

    async def _acquire(self, worker: RemoteWorker, body: AcquireIn, *, version: str | None,
                       gone: Callable[[], bool], on_gone: Callable[[Callable[[], None]], Callable[[], None]],
                       superseded: Callable[[], bool] = lambda: False, keep: bool = False) -> dict[str, Any]:
        where = ClaimFilter(types=tuple(body.types), tag_sets=tuple(frozenset(s) for s in body.slots))
        slots = [sorted(set(s)) for s in body.slots]

        async def claim() -> Acquired:
            return await self.store.acquire(worker.id, where, limit=body.max, now=self._clock(),
                                            lease_s=self.lease.duration_s, worker_id=worker.id, slots=slots,
                                            version=version)

        hold_s = min(body.wait_s, self.settings.max_wait_s) if self.parking.may_hold(worker.id) else 0.0
        changes = self.registry.changes
        acquired = await self._hold(worker, claim, ask=(where, slots, version), hold_s=hold_s,
                                    gone=lambda: gone() or superseded(), on_gone=on_gone)
        if acquired is None:  # the client went away while it was held: nothing leased
            return self._answer([], worker.state)
        self.registry.seen(acquired.worker, read_after=changes)
        claimed = acquired.claimed
        # leased as it left: back to the queue at once (kept for a repeat of its request_id, they would block
        # their tasks and count against the cap until they expire), unless a repeat already waits for them
        if claimed and gone() and not (keep and superseded()):
            await self._hand_back(acquired.worker.id, claimed)
            claimed = []
        self._leased(acquired.worker.id, claimed)
        self.registry.refuse_unless_served(acquired.worker, write=False)
        return self._answer(claimed, acquired.worker.state)

    async def _hold(self, worker: RemoteWorker, claim: Callable[[], Any], *, ask: object, hold_s: float,
                    gone: Callable[[], bool], on_gone: Callable[[Callable[[], None]], Callable[[], None]],
                    ) -> Acquired | None:
        """Claim, and while nothing came of it, wait for a wake and claim again, until hold_s is over. Each
        claim is shielded: once begun it is answered, so no lease it makes is lost to the deadline. A claim
        that would find what this worker's last empty one found (EmptyAnswers) is not made: it waits at once."""
        identity = worker.id
        parked = self.parking.park(identity)
        acquired: Acquired | None = None
        claimed_once: Acquired
        with anyio.move_on_after(hold_s) as scope:
            undo = on_gone(scope.cancel)
            try:
                while True:
                    self.parking.arm(parked)
                    if gone():
                        return None
                    changes, now = self.parking.changes, self._clock()
                    if worker.state is WorkerState.ENABLED and self.empty.still_empty(
                            identity, ask, changes=changes, now=now, trust_s=self.settings.max_wait_s):
                        acquired = acquired or Acquired(worker, [])
                        if hold_s <= 0:
                            break
                        self.parking.came_back_empty(parked)  # a wake handed on to it goes on: it has tried since
                        await parked.wait()
                        continue
                    with anyio.CancelScope(shield=True):
                        acquired = claimed_once = await claim()
                    if claimed_once.claimed:
                        self.empty.forget(identity)
                        self.parking.leased(parked)
                        break
                    self.parking.came_back_empty(parked)
                    if claimed_once.worker.state is not WorkerState.ENABLED:
                        self.empty.forget(identity)
                        break
                    self.empty.note(identity, ask, changes=changes, now=now)
                    if hold_s <= 0:
                        break
                    await parked.wait()
            finally:
                undo()
                self.parking.leave(parked)
        if acquired is None or (gone() and not acquired.claimed):
            return None
        return acquired

    def _leased(self, identity: str, claimed: list[Claimed]) -> None:
        self.metrics.answered.inc(("leased" if claimed else "empty",))
        self.metrics.leases.inc((), len(claimed))
        self.reports.leased(identity, claimed)

    async def _hand_back(self, identity: str, claimed: list[Claimed]) -> None:
        endings = [Ending(c.lease, Outcome(AttemptStatus.INTERRUPTED, GONE_BEFORE_ANSWER), self._clock())
                   for c in claimed]
        with anyio.CancelScope(shield=True):
            await self.store.finish_many(endings, policy=self._policy())
        log.info("worker %s went away before its acquire was answered: %d tasks back to the queue", identity,
                 len(claimed))
        self.wake(len(claimed))

    def _answer(self, claimed: list[Claimed], state: WorkerState) -> dict[str, Any]:
        return {"tasks": [{"task": TaskDetailOut.of(c.task).to_json(), "attempt_id": c.lease.attempt_id,
                           "lease_token": worker_token(c.task.id, c.lease.token),
                           "lease_expires_at": rfc3339(c.lease.expires_at)} for c in claimed],
                "worker_state": state.value, "lease_s": self.lease.duration_s,
                "renew_after_s": self.lease.renew_every_s}

    # writes

    async def _owned(self, worker: RemoteWorker, items: Sequence[LeaseIn]) -> set[str]:
        """The attempt ids of `items` that are the caller's; the others are said in the log, once per call. An
        attempt's owner never changes, so one the gateway knows as the caller's (it handed it out, or the
        store said so before) needs no read; the store is asked only about the rest."""
        ids = [i.attempt_id for i in items]
        mine = {a for a in ids if (known := self.attempts.get(a)) is not None and known.identity == worker.id}
        unknown = [a for a in ids if a not in mine]
        # a token must name the attempt's own task: one naming another is a lease the caller does not hold
        mine -= {i.attempt_id for i in items if (known := self.attempts.get(i.attempt_id)) is not None
                 and lease_of(i.attempt_id, i.lease_token).task_id != known.task_id}
        if unknown:
            owners = await self.store.attempt_owners(unknown)
            mine.update(a for a, owner in owners.items() if owner == worker.id)
        others = [i.attempt_id for i in items if i.attempt_id not in mine]
        if others:
            self.metrics.refused.inc((NOT_YOURS,), len(others))
            log.warning("worker %s wrote behind %d attempts it does not hold (%s): refused", worker.id, len(others),
                        ", ".join(others[:5]))
        return mine

    async def renew(self, worker: RemoteWorker, leases: Sequence[LeaseIn]) -> dict[str, Any]:
        self.registry.refuse_unless_served(worker, write=True)
        mine = await self._owned(worker, leases)
        now, lease_s = self._clock(), self.lease.duration_s
        held = [lease_of(i.attempt_id, i.lease_token) for i in leases if i.attempt_id in mine]
        lost = await self.store.renew(held, now=now, lease_s=lease_s) if held else {}
        answers: list[dict[str, Any]] = []
        for item in leases:
            if item.attempt_id not in mine:
                answers.append({"attempt_id": item.attempt_id, "status": "lost", "reason": NOT_YOURS})
            elif isinstance(why := lost.get(item.attempt_id), TaskCancelling):
                answers.append({"attempt_id": item.attempt_id, "status": "cancel"})
            elif why is not None:
                reason = await self._reason(lease := lease_of(item.attempt_id, item.lease_token), why)
                if reason is not None:
                    await self.reports.lost(worker.id, lease.task_id, item.attempt_id, reason)
                answers.append({"attempt_id": item.attempt_id, "status": "lost", "reason": reason or NOT_YOURS})
            else:
                answers.append({"attempt_id": item.attempt_id, "status": "held",
                                "lease_expires_at": rfc3339(now + lease_s)})
        return {"leases": answers, "worker_state": worker.state.value}

    async def phase(self, worker: RemoteWorker, notes: Sequence[NoteIn]) -> dict[str, Any]:
        self.registry.refuse_unless_served(worker, write=True)
        mine = await self._owned(worker, notes)
        kept = [n for n in notes if n.attempt_id in mine]
        written = [PhaseNote(lease := lease_of(n.attempt_id, n.lease_token), n.phase,
                             None if n.progress is None else n.progress.model_dump(),
                             await self._deadline_s(worker.id, lease, n.phase)) for n in kept]
        now = self._clock()
        lost = await self.store.set_phase(written, now=now) if written else {}
        for note, phase_note in zip(kept, written, strict=True):
            why = lost.get(note.attempt_id)
            if why is None:
                self.reports.noted(worker.id, phase_note.lease.task_id, note, now=now)
            elif not isinstance(why, TaskCancelling) and \
                    (reason := await self._reason(phase_note.lease, why)) is not None:
                await self.reports.lost(worker.id, phase_note.lease.task_id, note.attempt_id, reason)
        refused = [n.attempt_id for n in notes if n.attempt_id not in mine or n.attempt_id in lost]
        return {"lost": refused}

    async def _deadline_s(self, identity: str, lease: Lease, phase: Phase) -> float | None:
        """A note of a run phase under way (or over) starts the attempt's run deadline."""
        if phase not in (Phase.RUN, Phase.STOP):
            return None
        return await self.attempts.deadline_s(lease.attempt_id, lease.task_id, identity, rule=self.deadline,
                                              read=self.store.get)

    async def result(self, worker: RemoteWorker, body: ResultIn) -> tuple[ResultBatch, bool]:
        """Store a result batch once; (the acknowledged batch, whether it is new)."""
        self.registry.refuse_unless_served(worker, write=True)
        if sha256_of(body.payload) != body.sha256:
            self.metrics.refused.inc(("sha256",))
            raise InvalidRequest("sha256", "is not the SHA-256 of the payload as compact JSON with sorted keys")
        if not await self._owned(worker, [body]):
            raise LeaseGone(f"attempt {body.attempt_id}", NOT_YOURS)
        lease = lease_of(body.attempt_id, body.lease_token)
        batch = ResultBatch(body.plugin, body.sequence, _key_of(lease, body.idempotency_key), body.sha256, body.final,
                            body.payload, attempt_id=body.attempt_id)
        quota = ResultQuota(self.settings.max_results_per_attempt, self.settings.max_result_bytes_per_attempt)
        try:
            ack = await self.store.record_result(lease, batch, now=self._clock(), quota=quota)
        except Conflict:
            self.metrics.refused.inc(("conflict",))
            raise
        except QuotaExceeded as exc:
            self.metrics.refused.inc((exc.code,))
            log.warning("worker %s: %s", worker.id, exc)
            raise
        except LeaseLost as exc:
            raise await self._gone(worker.id, lease, exc) from None
        except ValueRefused as exc:
            log.error("task %s attempt %s of worker %s: result %s refused by the store: %s", lease.task_id,
                      lease.attempt_id, worker.id, batch.idempotency_key, exc)
            raise ValueRefused("the store refused a value of this result") from None
        self.reports.result(worker.id, lease.task_id, ack)
        return ack, ack.stored_now

    async def finish(self, worker: RemoteWorker, endings: Sequence[EndingIn]) -> dict[str, Any]:
        revoked = worker.state is WorkerState.REVOKED
        taken = _acknowledgements(endings) if revoked else endings
        if not (revoked and taken):  # what a revoked worker may still say is taken; a pending one holds nothing
            self.registry.refuse_unless_served(worker, write=True)
        mine = await self._owned(worker, taken)
        now = self._clock()
        kept = [e for e in taken if e.attempt_id in mine]
        answers = await self.store.finish_many(
            [Ending(lease_of(e.attempt_id, e.lease_token), _outcome(e), now) for e in kept], policy=self._policy())
        by_attempt = dict(zip((e.attempt_id for e in kept), answers, strict=True))
        out: list[dict[str, Any]] = []
        for ending in endings:
            answer = by_attempt.get(ending.attempt_id)
            if answer is None:
                out.append({"attempt_id": ending.attempt_id, "lost": NOT_YOURS if ending in taken else "revoked"})
            elif isinstance(answer, LeaseLost):
                lease = lease_of(ending.attempt_id, ending.lease_token)
                if (state := await self._ended_already(lease, ending.status)) is not None:
                    out.append({"attempt_id": ending.attempt_id, "state": state.value})
                    continue
                gone = await self._gone(worker.id, lease, answer)
                out.append({"attempt_id": ending.attempt_id, "lost": gone.reason})
            elif isinstance(answer, ValueRefused):  # sent again it would be refused again: said, not retried
                log.error("task %s attempt %s of worker %s: its ending was refused by the store: %s",
                          ending.lease_token.partition(".")[0], ending.attempt_id, worker.id, answer)
                out.append({"attempt_id": ending.attempt_id,
                            "error": {"code": answer.code, "message": "the store refused a value of this ending"}})
            elif isinstance(answer, TidepoolError):
                raise answer  # the store did not take it (StoreUnavailable): the worker sends it again
            else:
                await self._ended(worker.id, ending, answer)
                out.append({"attempt_id": ending.attempt_id, "state": answer.value})
        self.parking.wake_identity(worker.id)  # a place under its cap may have come free
        return {"endings": out}

    async def _ended(self, identity: str, ending: EndingIn, state: State) -> None:
        task_id = ending.lease_token.partition(".")[0]
        await self.reports.ended(identity, task_id, ending, state)
        if state is State.PENDING:  # interrupted: claimable again at once
            self.wake(1)
        log.info("task %s attempt %s of worker %s %s -> %s", task_id, ending.attempt_id, identity, ending.status,
                 state.value)

    async def _ended_already(self, lease: Lease, status: str) -> State | None:
        """The task's state when this attempt already ended with this status: the same ending sent again after
        its answer was lost, answered as the first time, with no event (the task did not lose its lease). The
        store forgets an ended lease's token, so the caller's ownership of the attempt, checked before, and
        the task its token names stand for it."""
        try:
            task = await self.store.get(lease.task_id)
        except (StoreUnavailable, TidepoolError):
            return None
        attempt = next((a for a in task.attempts if a.id == lease.attempt_id), None)
        if attempt is None or attempt.finished_at is None or attempt.status != status:
            return None
        return task.state

    async def _gone(self, identity: str, lease: Lease, lost: LeaseLost) -> LeaseGone:
        reason = "cancelled" if isinstance(lost, TaskCancelling) else await self._reason(lease, lost)
        if reason is None:  # its token names a task that is not its attempt's: as an attempt it does not hold
            self.metrics.refused.inc((NOT_YOURS,))
            return LeaseGone(f"attempt {lease.attempt_id}", NOT_YOURS)
        self.metrics.refused.inc((reason,))
        await self.reports.lost(identity, lease.task_id, lease.attempt_id, reason)
        return LeaseGone(f"task {lease.task_id} attempt {lease.attempt_id}", reason)

    async def _reason(self, lease: Lease, lost: LeaseLost) -> str | None:
        """Why a lease the store refused is gone: past its run deadline, cancelled, superseded (another attempt
        holds the task) or expired. None when the task its token names (unknown, or another's) has no such
        attempt: the caller is answered as for an attempt it does not hold, and nothing is published for that
        task, so a worker learns nothing of tasks that are not its own. StoreUnavailable when the task cannot be
        read: until the token's task is known to hold the attempt, nothing is said or published of either (the
        worker sends its write again)."""
        if isinstance(lost, DeadlinePassed):  # the store found it fenced on task, attempt and token
            return lost.reason
        try:
            task = await self.store.get(lease.task_id)
        except TaskNotFound:
            return None
        if not any(a.id == lease.attempt_id for a in task.attempts):
            return None
        if task.state in (State.CANCELLING, State.CANCELLED):
            return "cancelled"
        if task.attempts and task.attempts[-1].id != lease.attempt_id:
            return "superseded"
        attempt = task.attempts[-1] if task.attempts else None
        if attempt is not None and attempt.deadline_at is not None and attempt.deadline_at <= self._clock():
            return DeadlinePassed.reason  # and the reconciler has ended it since
        return "expired"


def _key_of(lease: Lease, key: str) -> str:
    """A result key as the store holds it: within the caller's task (`<task id>:<key>`, as a local plugin's own
    key is), unless it is so already or is its attempt's own (`<attempt id>:...`). The store finds a key among
    every task's results: taken as sent, a key would let one worker store a result under the key of a task it
    does not hold, so that task's own result is refused (409) or answered with the other's. The lease's task and
    attempt are the caller's: the store fences on both before it looks the key up."""
    if key.startswith((f"{lease.task_id}:", f"{lease.attempt_id}:")):
        return key
    return f"{lease.task_id}:{key}"


def _acknowledgements(endings: Sequence[EndingIn]) -> list[EndingIn]:
    """What a revoked worker may still write: that an attempt the revoke cancelled has stopped (its processes are
    gone), so that the task reads `cancelled` now rather than when its lease would have ended."""
    return [e for e in endings if e.status == "cancelled"]


def _outcome(ending: EndingIn) -> Outcome:
    error = None
    if ending.error is not None:
        retryable = True if ending.retryable is None else ending.retryable
        error = TaskError(ending.error.code, ending.error.message, retryable)
    elif ending.retryable is not None and ending.status != "succeeded":
        error = TaskError(ending.status, f"the attempt ended {ending.status}", ending.retryable)
    return Outcome(AttemptStatus(ending.status), error, ending.exit_status, ending.stderr_tail, scope=ending.scope)



