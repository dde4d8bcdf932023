"""The engine: one claimed task run through its phases, initialize -> prepare -> run plugins -> stop.

Each attempt runs in its own cancel scope (cancel, shutdown interrupt and lost leases fire it);
prepare acquires a resource slot when the task needs tags (tasks that need none skip it at no
cost); the run phase is bounded by the task's timeout and each plugin by its own; the stop phase
always runs, shielded and bounded by stop_timeout_s, and releases the slot and removes the work
directory whatever happened. How the attempt ended is posted to its outcomes, which write it behind
the worker while it goes on to its next task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from ..errors import BlobTooLarge, PluginError, QuotaExceeded, ValueRefused
from ..events import EventBus
from ..lifecycle import RetryPolicy
from ..model import (
    CANCELLED_ON_REQUEST,
    Artifact,
    AttemptStatus,
    Claimed,
    Lease,
    Outcome,
    Phase,
    ResultBatch,
    Task,
    TaskError,
)
from ..plugins import PluginDef, Registry, denied
from ..plugins.command.template import template_values
from ..settings import ArtifactSettings
from ..store.port import ArtifactQuota, ResultQuota, WorkerPort
from .context import TaskContext
from .inputs import place_inputs
from .leases import Held, LeaseKeeper
from .outcomes import Outcomes
from .resources import ResourcePool, Slot
from .workdirs import remove_workdir

if TYPE_CHECKING:
    from ..settings import ExecutionSettings, RetrySettings

log = logging.getLogger("tidepool.engine")
MAX_RAN = 10_000  # plugins remembered between two supervisor ticks, for the held-up loop's warning
FENCED = TaskError("interrupted", "stopped by its node's fence: no heartbeat saved, the fleet would run it elsewhere")


@dataclass(frozen=True)
class EngineConfig:
    timeout_s: float = 600.0
    prepare_timeout_s: float = 60.0
    stop_timeout_s: float = 30.0
    result_quota: ResultQuota | None = None  # what one attempt may store; a remote worker's gateway sets its own
    artifact_quota: ArtifactQuota = field(default_factory=lambda: artifact_quota(ArtifactSettings()))

    @classmethod
    def of(cls, section: ExecutionSettings, artifacts: ArtifactSettings) -> EngineConfig:
        return cls(timeout_s=section.timeout_s, prepare_timeout_s=section.prepare_timeout_s,
                   stop_timeout_s=section.stop_timeout_s,
                   result_quota=ResultQuota(section.max_results_per_attempt, section.max_result_bytes_per_attempt),
                   artifact_quota=artifact_quota(artifacts))


def artifact_quota(section: ArtifactSettings) -> ArtifactQuota:
    return ArtifactQuota(section.max_per_attempt, section.max_attempt_bytes, section.max_blob_bytes)


class Engine:
    def __init__(self, store: WorkerPort, registry: Registry, leases: LeaseKeeper, events: EventBus, *,
                 config: EngineConfig, policy: RetryPolicy, work_root: Path,
                 resources: ResourcePool | None = None, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self.registry = registry
        self._leases = leases
        self._events = events
        self.config = config
        self.policy = policy
        self._work_root = work_root
        self.resources = resources
        self._clock = clock
        self._running: dict[str, tuple[TaskContext, Held, str]] = {}  # started, outcome not posted yet
        self._ran: dict[str, str] = {}  # task id -> plugin, of what ran since plugins_since_asked() was
        self._said: set[tuple[str, str]] = set()  # (attempt, results|artifacts) refused past a quota: said once
        self.outcomes = Outcomes(store, leases, events, policy=lambda: self.policy, clock=clock)

    def configure(self, registry: Registry, execution: ExecutionSettings, retry: RetrySettings,
                  artifacts: ArtifactSettings) -> None:
        """A reload's task types, deadlines, quotas and retry policy, for the attempts that start from now on."""
        self.registry = registry
        self.config = EngineConfig.of(execution, artifacts)
        self.policy = retry.policy()

    def plugins_since_asked(self) -> dict[str, str]:
        """Task id -> plugin of every attempt that ran since the last call: running then, started since, or
        running now (its latest plugin; "" before the first). What held the event loop up is among them."""
        now = {ctx.task.id: ctx.plugin for ctx, _, _ in self._running.values()}
        ran, self._ran = {**self._ran, **now}, now
        return ran

    def abandon_running(self) -> None:
        """Shutdown, once running tasks had their time to stop: post every attempt still running as
        interrupted, which puts its task back to pending without using an attempt. Left to expire with the
        lease, it would be charged as a crash after the restart, and could fail a task the operator only
        stopped the node under. What such an attempt posts later is refused by its lease's fence."""
        items = list(self._running.values())
        self._running.clear()
        for ctx, held, worker_id in items:
            log.warning("task %s attempt %s did not stop in time at shutdown: recorded as interrupted", ctx.task.id,
                        held.lease.attempt_id)
            self.outcomes.conclude(ctx.task, held, Outcome(AttemptStatus.INTERRUPTED, TaskError(
                "interrupted", "interrupted by shutdown; did not stop in time")), worker_id)

    async def run(self, claimed: Claimed, worker_id: str, *, held: Held | None = None) -> None:
        """Execute one attempt and post how it ended (written behind: see Outcomes)."""
        task, lease = claimed.task, claimed.lease
        held = held or self._leases.hold(lease)
        # partial, not a lambda over ctx: a context holding a closure over itself is a reference cycle,
        # and every object of the attempt would wait for the cycle collector (measured: ~10 per task).
        ctx = TaskContext(task, attempt_id=lease.attempt_id, workdir=f"{self._work_root}/{lease.attempt_id}",
                          report_progress=partial(self._progress, held, worker_id),
                          store_result=partial(self._result, held, worker_id),
                          store_artifact=partial(self._artifact, held))
        self._running[lease.attempt_id] = (ctx, held, worker_id)
        try:
            outcome = await self._attempt(ctx, held, worker_id)
        except BaseException:
            if self._running.pop(lease.attempt_id, None) is not None:
                self._leases.release(held)
            raise
        finally:
            self._said.difference_update({(lease.attempt_id, "results"), (lease.attempt_id, "artifacts")})
        if self._running.pop(lease.attempt_id, None) is not None:  # else abandoned at shutdown, posted already
            self.outcomes.conclude(task, held, outcome, worker_id)

    async def _attempt(self, ctx: TaskContext, held: Held, worker_id: str) -> Outcome | None:
        outcome = None
        with held.scope:
            try:
                outcome = await self._phases(ctx, held, worker_id)
            finally:
                self._enter(ctx, held, worker_id, Phase.STOP)
                if self._has_cleanup(ctx):
                    with anyio.move_on_after(self.config.stop_timeout_s, shield=True) as stopping:
                        await self._clean_up(ctx)
                    if stopping.cancelled_caught:  # a VM left running or unreverted: the operator must know
                        log.warning("task %s attempt %s: stop phase cut short after execution.stop_timeout_s "
                                    "(%gs); %s", ctx.task.id, held.lease.attempt_id, self.config.stop_timeout_s,
                                    f"resource {ctx.resource} released before its stop hook finished"
                                    if ctx.resource is not None else "its work directory may be left behind")
        if outcome is None:
            outcome = self._cut_short(ctx, held)
        if outcome is None:
            return None  # the lease is gone: nothing of this attempt may be written
        # However it ended, the last command's exit status and stderr tail stay on the attempt, for the operator.
        outcome.exit_status, outcome.stderr_tail = ctx.exit_status, ctx.stderr_tail
        return outcome

    def _cut_short(self, ctx: TaskContext, held: Held) -> Outcome | None:
        """How an attempt whose scope was cancelled ended; None when its lease is gone."""
        if held.why == "cancel":
            return Outcome(AttemptStatus.CANCELLED, CANCELLED_ON_REQUEST)
        if held.why == "interrupt":
            return Outcome(AttemptStatus.INTERRUPTED, TaskError("interrupted", "interrupted by shutdown"))
        if held.why == "fenced":  # written if the lease is still ours when the store answers: back at once
            return Outcome(AttemptStatus.INTERRUPTED, FENCED)
        if held.why is None and held.scope.cancelled_caught:  # the run phase's deadline passed
            return self._timed_out(ctx.task, f"run phase timed out after {self._run_timeout_s(ctx.task)}s")
        return None

    async def _phases(self, ctx: TaskContext, held: Held, worker_id: str) -> Outcome:
        task = ctx.task
        self._enter(ctx, held, worker_id, Phase.INITIALIZE)
        try:
            plugins = self.registry.plugins_for(task.type)
            self._enter(ctx, held, worker_id, Phase.PREPARE)
            if task.inputs:  # before the slot: its machinery's start hook may take them to the VM
                ctx.inputs = await place_inputs(self._store, held, task, ctx.workdir)
            tags = self._required_tags(task)
            if tags:  # the host-only fast path skips this: no await, no scope
                ctx.resource = await self._acquire(ctx, tags)
            await _cancelled_yet(held)
            # The store holds the attempt to a deadline of its own past this one, the stop phase and a lease
            # later: a worker whose own timeout failed it cannot keep the task past that.
            held.deadline_s = self._run_timeout_s(task) + self.config.stop_timeout_s + self._leases.lease_s
            self._enter(ctx, held, worker_id, Phase.RUN)
            # The attempt's own scope carries the run deadline: one scope per task, not two. It is not
            # reset afterwards (a timer each time): once the plugins are done nothing in it awaits
            # unshielded, so a deadline passing then changes nothing.
            held.scope.deadline = anyio.current_time() + self._run_timeout_s(task)
            for plugin in plugins:
                await self._run_plugin(ctx, held, plugin, worker_id)
            return Outcome(AttemptStatus.SUCCEEDED, scope=ctx.scope)
        except _PluginTimedOut as exc:
            return self._timed_out(task, str(exc))
        except QuotaExceeded as exc:  # its plugin let the refusal through: retried, it would meet it again
            return Outcome(AttemptStatus.FAILED, TaskError(exc.code, str(exc), retryable=False))
        except PluginError as exc:  # the traceback only of what escaped: a PluginError says all it means to
            log.warning("task %s attempt %s failed: %s (%s)", task.id, held.lease.attempt_id, exc, exc.code,
                        exc_info=isinstance(exc, Escaped))
            return Outcome(AttemptStatus.FAILED, TaskError(exc.code, str(exc), exc.retryable))
        except Exception as exc:
            log.exception("task %s attempt %s: plugin %s raised", task.id, held.lease.attempt_id, ctx.plugin)
            return Outcome(AttemptStatus.FAILED, TaskError("plugin_error", f"{type(exc).__name__}: {exc}"))

    async def _run_plugin(self, ctx: TaskContext, held: Held, plugin: PluginDef, worker_id: str) -> None:
        await _cancelled_yet(held)
        if not self.registry.allowed(plugin.name):  # allow/deny apply at run time too
            raise denied(plugin.name, ctx.task.type)
        ctx.enter_plugin(plugin.name)
        if len(self._ran) < MAX_RAN:  # read (and emptied) every supervisor tick; bounded all the same
            self._ran[ctx.task.id] = plugin.name
        self._events.publish("plugin.started", ctx.task.id, worker_id, plugin.name)
        started, outcome = time.monotonic(), "stopped"  # unless it returns or raises: the attempt was stopped
        own_deadline = None  # no scope of its own unless it has a timeout: one scope per task costs enough
        try:
            if plugin.timeout_s is None:
                await call_plugin(plugin, ctx)
            else:
                with anyio.move_on_after(plugin.timeout_s) as own_deadline:
                    await call_plugin(plugin, ctx)
            # It returned; a plugin may have swallowed what stopped it. Its attempt's stop (the run deadline,
            # a cancel, a lost lease, a shutdown) comes first, as though the plugin had let it through ...
            await _cancelled_yet(held)
            if own_deadline is not None and own_deadline.cancel_called:  # ... then its own deadline
                outcome = "timed_out"
                raise _PluginTimedOut(f"plugin {plugin.name} timed out after {plugin.timeout_s}s")
            outcome = "succeeded"
        except Exception:
            # One that turned its attempt's stop into an error of its own was stopped all the same.
            await _cancelled_yet(held)
            if outcome == "stopped":
                outcome = "failed"
            raise
        finally:  # every plugin.started has its plugin.finished, however the plugin ended
            self._events.publish("plugin.finished", ctx.task.id, worker_id, plugin.name,
                                 round(time.monotonic() - started, 6), outcome)

    def _required_tags(self, task: Task) -> frozenset[str]:
        type_tags = self.registry.required_tags(task.type)
        return type_tags.union(task.required_tags) if task.required_tags else type_tags

    async def _acquire(self, ctx: TaskContext, tags: frozenset[str]) -> Slot:
        if self.resources is None:
            raise PluginError(f"task needs tags {sorted(tags)} but this node has no resources",
                              code="unserviceable", retryable=False)
        # The hooks get what a command's placeholders get: a start hook may copy {input:sample} into the VM.
        values = template_values(ctx.payload, task_id=ctx.task.id, attempt=ctx.task.attempt,
                                 workdir=f"{self._work_root}/{ctx.attempt_id}", inputs=ctx.inputs)
        slot = await self.resources.acquire(tags, timeout_s=self.config.prepare_timeout_s, values=values)
        log.debug("task %s holds resource %s", ctx.task.id, slot)
        return slot

    def _has_cleanup(self, ctx: TaskContext) -> bool:
        return ctx.resource is not None or ctx.workdir_used

    async def _clean_up(self, ctx: TaskContext) -> None:
        """The stop phase's work: runs shielded and bounded, whatever ended the attempt."""
        if ctx.resource is not None and self.resources is not None:
            try:
                await self.resources.stop(ctx.resource)
            finally:  # released even when the stop hook overran stop_timeout_s
                self.resources.release(ctx.resource)
        if ctx.workdir_used:
            await anyio.to_thread.run_sync(remove_workdir, ctx.workdir)

    def _enter(self, ctx: TaskContext, held: Held, worker_id: str, phase: Phase) -> None:
        self._leases.note(held, phase)
        self._events.publish("task.phase", ctx.task.id, worker_id, phase.value, held.lease.attempt_id)

    def _progress(self, held: Held, worker_id: str, ctx: TaskContext, fraction: float, message: str) -> None:
        progress = {"fraction": fraction, "message": message}
        self._leases.note(held, Phase.RUN, progress)
        self._events.publish("task.progress", task_id=ctx.task.id, worker_id=worker_id, plugin=ctx.plugin,
                             **progress)

    async def _result(self, held: Held, worker_id: str, batch: ResultBatch) -> ResultBatch:
        """Store a plugin's result batch. A store that does not answer is tried again for as long as this node
        holds the lease: an outage costs the plugin a wait, never its attempt (the fence keeps a retry safe).
        Once the lease keeper gives the lease up it cancels the attempt, this wait included: its end is the
        lease's, not the plugin's (no StoreUnavailable for the plugin to take for its own failure)."""
        try:
            ack = await held.asking(lambda: self._store.record_result(held.lease, batch, now=self._clock(),
                                                                      quota=self.config.result_quota))
        except QuotaExceeded as exc:
            self._said_refused(held.lease, "results", f"result refused, over its quota ({exc}); the plugin's emit "
                                                      "raises QuotaExceeded from now on")
            raise
        except ValueRefused as exc:  # sent again it would be refused again: the plugin's emit fails
            log.error("task %s attempt %s: result %s refused by the store: %s", held.lease.task_id,
                      held.lease.attempt_id, batch.idempotency_key, exc)
            raise PluginError(f"the store refused a value of result {batch.sequence} of {batch.plugin}",
                              code=exc.code, retryable=False) from exc
        self._events.publish("task.result", task_id=held.lease.task_id, worker_id=worker_id, plugin=ack.plugin,
                             sequence=ack.sequence, idempotency_key=ack.idempotency_key, final=ack.final)
        return ack

    async def _artifact(self, held: Held, name: str, source: Path | bytes, content_type: str | None) -> Artifact:
        """Record a plugin's artifact; a store that does not answer is asked again, as for results."""
        try:
            artifact = await held.asking(lambda: self._store.record_artifact(
                held.lease, name, source, content_type=content_type, now=self._clock(),
                quota=self.config.artifact_quota))
        except (QuotaExceeded, BlobTooLarge) as exc:
            self._said_refused(held.lease, "artifacts", f"artifact {name} refused ({exc}); the plugin's artifact() "
                                                        "raises from now on for each one past [artifacts]' quotas")
            raise
        log.debug("task %s attempt %s: artifact %s recorded (%s, %d bytes)", held.lease.task_id,
                  held.lease.attempt_id, name, artifact.sha256, artifact.size)
        return artifact

    def _said_refused(self, lease: Lease, what: str, line: str) -> None:
        """One line per attempt and kind (results, artifacts): a plugin may go on offering them past its quota,
        refused every time."""
        if (lease.attempt_id, what) not in self._said:
            self._said.add((lease.attempt_id, what))
            log.warning("task %s attempt %s: %s", lease.task_id, lease.attempt_id, line)

    def _run_timeout_s(self, task: Task) -> float:
        """The task's own timeout, else its type's, else execution.timeout_s."""
        settings = self.registry.types.get(task.type)
        return task.timeout_s or (settings and settings.timeout_s) or self.config.timeout_s

    def _timed_out(self, task: Task, message: str) -> Outcome:
        settings = self.registry.types.get(task.type)
        retry = settings is not None and settings.retry_on_timeout
        return Outcome(AttemptStatus.TIMED_OUT, TaskError("timeout", message, retry))


class _PluginTimedOut(Exception):
    pass


async def _cancelled_yet(held: Held) -> None:
    """A safe point between phases and plugins: deliver a pending cancel, else go on without yielding."""
    if held.scope.cancel_called:
        await anyio.lowlevel.checkpoint()


# One call of a plugin within an attempt: whatever the plugin raises ends that attempt, never its worker.
#
# A library's SystemExit, a KeyboardInterrupt of the plugin's own, or a CancelledError nobody asked for
# (awaiting a task it cancelled itself) would otherwise end the worker's loop as though the pool were
# stopping it. Each becomes the attempt's failure; a cancellation that is ours goes on up.

class Escaped(PluginError):
    """What a plugin raised that is no Exception, as the failure of its attempt; the original is the cause."""


async def call_plugin(plugin: PluginDef, ctx: TaskContext) -> None:
    """Run a plugin. What it raises that is no Exception fails its attempt, as Escaped; a cancellation of
    ours (the attempt stopped, a deadline, shutdown) goes on up."""
    try:
        await plugin.run(ctx)
    except (Exception, GeneratorExit):  # GeneratorExit: the coroutine itself is being closed
        raise
    except BaseException as exc:
        # Ours only if a cancellation of this task is under way: anyio delivers every one of its scopes'
        # through asyncio's counted cancel. A stray one while the attempt's stop is pending but not yet
        # delivered (or under a shield) becomes the failure below, and the engine delivers the stop
        # at its next safe point.
        if isinstance(exc, anyio.get_cancelled_exc_class()) and _being_cancelled():
            raise
        raise Escaped(f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} raised") from exc


def _being_cancelled() -> bool:
    """A cancellation of this task is under way (anyio delivers its scopes' through asyncio's, counted)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
