"""The events of remote attempts as the gateway publishes them: what the worker protocol tells of an attempt,
under the names and fields a local attempt's engine uses, and nothing the protocol does not tell.

A phase note carries an attempt's phase and progress but not the plugin that reported it, so a remote
`task.progress` has `plugin: null`, and there is no `plugin.started` or `plugin.finished` for a remote attempt.
A result names its plugin (`task.result` has it). A phase is published when it changes, though notes repeat it;
progress at most once every PROGRESS_EVERY_S per attempt.
A lease that expired under the worker is published once per attempt, as `task.lease_lost`, when the gateway
first refuses a write behind it; not once another attempt holds the task, whose events share its task id.
A task's end is published as a local attempt's is, with bare arguments (events.py): its data is built only if
something reads it. Its lease carries `node_id` beside a local lease's fields, so it is published with its data.
"""

from __future__ import annotations

from ..errors import TidepoolError
from ..events import EventBus
from ..model import Claimed, ResultBatch, State
from ..store import Store
from .attempts import RemoteAttempt, RemoteAttempts
from .schemas import EndingIn, NoteIn

LOST = ("expired", "deadline")
# A worker may send progress notes as fast as it likes: published as they came, they would push every other
# event out of the ring the event stream replays from. The store still keeps each attempt's latest progress.
PROGRESS_EVERY_S = 1.0  # a cancelled attempt, or a revoked worker's, ends as cancelled instead


class AttemptEvents:
    def __init__(self, events: EventBus, attempts: RemoteAttempts, store: Store) -> None:
        self._events = events
        self._attempts = attempts
        self._store = store

    def leased(self, identity: str, claimed: list[Claimed]) -> None:
        for c in claimed:
            self._attempts.add(c.lease.attempt_id, RemoteAttempt(c.task.id, c.task.type, identity,
                                                                 limits=(c.task.type, c.task.timeout_s)))
            self._events.publish("task.leased", task_id=c.task.id, worker_id=identity, node_id=identity,
                                 attempt_id=c.lease.attempt_id, attempt=c.task.attempt, type=c.task.type,
                                 available_at=c.task.available_at)

    def noted(self, identity: str, task_id: str, note: NoteIn, *, now: float) -> None:
        attempt = self._attempts.known(note.attempt_id, task_id, identity)
        if attempt.phase != note.phase.value:
            attempt.phase = note.phase.value
            self._events.publish("task.phase", task_id=task_id, worker_id=identity, phase=note.phase.value,
                                 attempt_id=note.attempt_id)
        if note.progress is not None and now - attempt.progress_at >= PROGRESS_EVERY_S:
            attempt.progress_at = now
            self._events.publish("task.progress", task_id=task_id, worker_id=identity, plugin=None,
                                 **note.progress.model_dump())

    def result(self, identity: str, task_id: str, ack: ResultBatch) -> None:
        self._events.publish("task.result", task_id=task_id, worker_id=identity, plugin=ack.plugin,
                             sequence=ack.sequence, idempotency_key=ack.idempotency_key, final=ack.final)

    async def ended(self, identity: str, task_id: str, ending: EndingIn, state: State) -> None:
        task_type = await self._type_of(ending.attempt_id, task_id)
        self._attempts.drop(ending.attempt_id)
        error = None if ending.error is None else {"code": ending.error.code, "message": ending.error.message}
        if state is State.RETRY_WAIT:
            self._events.publish("task.retry_scheduled", task_id=task_id, worker_id=identity, error=error,
                                 type=task_type)
        elif state.terminal:
            self._events.publish("task.finished", task_id, identity, state.value, error, task_type)

    async def lost(self, identity: str, task_id: str, attempt_id: str, reason: str) -> None:
        """A write refused for `reason`: a lease the worker no longer holds is said once."""
        if reason not in LOST:
            return
        if not self._attempts.first_loss(attempt_id, task_id, identity):
            return
        self._events.publish("task.lease_lost", task_id=task_id, worker_id=identity, attempt_id=attempt_id,
                             type=await self._type_of(attempt_id, task_id), reason=reason)

    async def _type_of(self, attempt_id: str, task_id: str) -> str:
        known = self._attempts.get(attempt_id)
        if known is not None and known.type is not None:
            return known.type
        try:
            task_type = (await self._store.get(task_id)).type
        except TidepoolError:
            return "unknown"
        if known is not None:
            known.type = task_type
        return task_type
