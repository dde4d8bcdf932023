"""The slot pool: this node's resource slots, handed to tasks whose required tags they carry.

`[resources.NAME]` gives `count` slots with the same `tags`. A task needing tags waits in its
prepare phase for a free slot whose tags include all of them; waiters are served first come,
first served among those a freed slot can serve. A slot is handed straight from the task that
releases it to the first matching waiter, so a newcomer never overtakes a task already waiting.

Machinery: a resource may name a Python object by dotted path (`plugin = "pkg.mod:obj"`, or a
module `"pkg.mod"`) with two coroutine functions, `async start(slot)` and `async stop(slot)`.
`start` runs after the slot is acquired, within the same prepare_timeout_s (revert a VM, check a
licence server); `stop` runs in the task's stop phase before the slot is released (power the VM
off). `stop` is called only for a slot whose `start` returned; a `start` that fails or is cancelled
must clean up after itself. A class is instantiated once, with no arguments, when the node starts.

A hook that takes a second argument, `async start(slot, values)`, gets the task's placeholders as a command
template does (payload fields, `task_id`, `attempt`, `workdir`, and `input:NAME` the path of each input,
placed before the slot is taken): `render_argv(["vmcopy", "{input:sample}"], values)` builds its command,
and so the sample reaches the VM in prepare. `stop` gets the same values as its `start`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import anyio

from ..errors import ConfigError, PluginError
from ..settings import ResourceSettings

log = logging.getLogger("tidepool.resources")


@dataclass(frozen=True, slots=True)
class Slot:
    """One unit of a resource: `vm[1]` is the second slot of `[resources.vm]`."""

    name: str
    index: int
    tags: frozenset[str]

    def __str__(self) -> str:
        return f"{self.name}[{self.index}]"


@runtime_checkable
class Machinery(Protocol):
    """Brings a slot's real thing up before a task uses it and down afterwards."""

    async def start(self, slot: Slot) -> None: ...

    async def stop(self, slot: Slot) -> None: ...


@dataclass(frozen=True, slots=True)
class ResourceStats:
    tags: tuple[str, ...]
    count: int
    in_use: int


@dataclass(frozen=True, slots=True)
class SlotPoolStats:
    resources: Mapping[str, ResourceStats]
    waiting: int  # tasks in their prepare phase waiting for a slot


@dataclass(eq=False)
class _Waiter:
    required: frozenset[str]
    ready: anyio.Event = field(default_factory=anyio.Event)
    slot: Slot | None = None  # set by the releasing task: the slot is ours from then on


class ResourcePool:
    def __init__(self, resources: Mapping[str, ResourceSettings], *,
                 machinery: Mapping[str, Machinery] | None = None,
                 on_free: Callable[[], None] = lambda: None) -> None:
        self._counts = {name: r.count for name, r in resources.items()}
        self._tags = {name: frozenset(r.tags) for name, r in resources.items()}
        self._machinery = dict(machinery or {})
        self.on_free = on_free  # a slot became free with nobody waiting for it: claim more work
        self._free: dict[Slot, None] = {Slot(name, i, self._tags[name]): None
                                         for name, n in self._counts.items() for i in range(n)}
        self._in_use: set[Slot] = set()
        self._started: dict[Slot, Mapping[str, object]] = {}  # started slots, with their task's values
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._free_tag_sets: tuple[frozenset[str], ...] | None = None
        self._promised: collections.Counter[frozenset[str]] = collections.Counter()  # see claiming()
        self._held_back = False  # a claim was made without a set some other claim had been promised
        self.version = 0  # bumped when the free slots change; the claim filter is cached on it

    @classmethod
    def from_settings(cls, resources: Mapping[str, ResourceSettings], *,
                      on_free: Callable[[], None] = lambda: None) -> ResourcePool:
        machinery = {name: load_machinery(r.plugin, key=f"resources.{name}.plugin")
                     for name, r in resources.items() if r.plugin}
        return cls(resources, machinery=machinery, on_free=on_free)

    # what can be served

    def can_serve(self, required_tags: Iterable[str]) -> bool:
        """Whether some slot of this node could ever serve these tags, busy or not."""
        required = frozenset(required_tags)
        return any(required <= tags for tags in self.tag_sets())

    def tag_sets(self) -> tuple[frozenset[str], ...]:
        """The tag set of each resource of this node, busy or free: what it could ever serve."""
        return tuple(self._tags.values())

    def free_tag_sets(self) -> tuple[frozenset[str], ...]:
        """The distinct tag sets of the free slots no claim in flight may take: what a claim of this node may
        ask for now (a claim takes only tasks whose required tags a free slot can serve)."""
        if self._free_tag_sets is None:  # reset by every change of the free slots and of the promises
            free = collections.Counter(slot.tags for slot in self._free)
            self._free_tag_sets = tuple(tags for tags, n in free.items() if n > self._promised[tags])
            self._held_back |= len(self._free_tag_sets) < len(free)
        return self._free_tag_sets

    @contextlib.contextmanager
    def claiming(self, tag_sets: Iterable[frozenset[str]]) -> Iterator[None]:
        """While a claim that may bring a task for these tag sets is in flight, one free slot of each is
        promised to it: a claim made meanwhile does not ask for the same last slot, so one freed slot is
        not claimed twice, the second task left waiting in prepare until it fails (prepare_timeout). The
        claim's worker takes its slot in the same step as the promise ends (no await between).

        A claim held back meanwhile may have missed a task the promised slot can serve: if the slot is
        still free once the worker has taken what it claimed, a worker is woken to look again."""
        promised = [tags for tags in tag_sets if tags]
        if not promised:  # a node without resources, or none free: nothing to promise, no filter to redo
            yield
            return
        self._promised.update(promised)
        self._changed()
        try:
            yield
        finally:
            self._promised.subtract(promised)
            self._changed()
            if self._held_back:
                self._held_back = False
                asyncio.get_running_loop().call_soon(self._wake_if_free, promised)

    def _wake_if_free(self, tag_sets: list[frozenset[str]]) -> None:
        if any(slot.tags in tag_sets for slot in self._free):
            self.on_free()

    def statistics(self) -> SlotPoolStats:
        in_use = collections.Counter(slot.name for slot in self._in_use)
        return SlotPoolStats({name: ResourceStats(tuple(sorted(self._tags[name])), count, in_use[name])
                              for name, count in self._counts.items()}, len(self._waiters))

    # acquire and release

    async def acquire(self, required_tags: Iterable[str], *, timeout_s: float,
                      values: Mapping[str, object] | None = None) -> Slot:
        """A free slot whose tags include required_tags, started (with the task's placeholder `values`, for
        hooks that take them); waits up to timeout_s in all.

        Raises PluginError "unserviceable" (not retried) at once when no slot of this node could
        ever serve the tags, and "prepare_timeout" (retried) when none came free in time.
        """
        required = frozenset(required_tags)
        if not self.can_serve(required):
            raise PluginError(f"no resource of this node has tags {sorted(required)}; configured: "
                              f"{ {n: sorted(t) for n, t in self._tags.items()} }",
                              code="unserviceable", retryable=False)
        slot = None
        with anyio.move_on_after(timeout_s) as scope:
            slot = self._take(required) or await self._wait(required)
            await self._start(slot, values or {})
            return slot
        assert scope.cancelled_caught
        if slot is not None:  # a slot was free; its start hook overran (and the slot went back)
            raise PluginError(f"resource {slot}: machinery start hook did not finish within {timeout_s}s",
                              code="prepare_timeout")
        raise PluginError(f"no slot with tags {sorted(required)} became free within {timeout_s}s "
                          f"({self._busy_summary()})", code="prepare_timeout")

    async def stop(self, slot: Slot) -> None:
        """Run the machinery stop hook of a started slot; a failing hook is logged, never raised."""
        machinery = self._machinery.get(slot.name)
        if machinery is None or slot not in self._started:
            return
        values = self._started.pop(slot)
        try:
            await _call_hook(machinery.stop, slot, values)
        except Exception:
            log.exception("resource %s: machinery stop hook failed", slot)

    def release(self, slot: Slot) -> None:
        """Give the slot back: to the first waiter it can serve, else to the free list. Idempotent."""
        if slot not in self._in_use:
            return
        self._started.pop(slot, None)
        for waiter in self._waiters:
            if waiter.required <= slot.tags:
                self._waiters.remove(waiter)
                waiter.slot = slot  # stays in use: handed over without a moment free
                waiter.ready.set()
                return
        self._in_use.discard(slot)
        self._free[slot] = None
        self._changed()
        self.on_free()

    # inside

    def _take(self, required: frozenset[str]) -> Slot | None:
        # A free slot no earlier waiter wanted (release hands slots to waiters first), and not one promised to
        # a claim in flight (see claiming()): take it.
        free = collections.Counter(slot.tags for slot in self._free)
        for slot in self._free:
            if required <= slot.tags and free[slot.tags] > self._promised[slot.tags]:
                del self._free[slot]
                self._in_use.add(slot)
                self._changed()
                return slot
        return None

    async def _wait(self, required: frozenset[str]) -> Slot:
        waiter = _Waiter(required)
        self._waiters.append(waiter)
        try:
            await waiter.ready.wait()
        except BaseException:
            if waiter.slot is not None:  # handed over just as we were cancelled: pass it on
                self.release(waiter.slot)
            else:
                self._waiters.remove(waiter)
            raise
        assert waiter.slot is not None
        return waiter.slot

    async def _start(self, slot: Slot, values: Mapping[str, object]) -> None:
        machinery = self._machinery.get(slot.name)
        if machinery is None:
            return
        try:
            await _call_hook(machinery.start, slot, values)
        except BaseException as exc:
            self.release(slot)
            if isinstance(exc, Exception):
                raise PluginError(f"resource {slot}: machinery start hook failed: {type(exc).__name__}: {exc}",
                                  code="resource_start_failed") from exc
            raise
        self._started[slot] = values

    def _changed(self) -> None:
        self._free_tag_sets = None
        self.version += 1

    def _busy_summary(self) -> str:
        stats = self.statistics()
        return ", ".join(f"{n} {r.in_use}/{r.count} in use" for n, r in stats.resources.items())


def load_machinery(path: str, *, key: str) -> Machinery:
    """Import "pkg.mod" or "pkg.mod:attr"; a class is instantiated with no arguments."""
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        if attr:
            obj = getattr(obj, attr)
        if isinstance(obj, type):
            obj = obj()
    except Exception as exc:
        raise ConfigError(f"config: {key}: cannot load {path!r}: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, Machinery):
        raise ConfigError(f"config: {key}: {path!r} has no async start(slot) and stop(slot)")
    return obj


async def _call_hook(hook: Callable[..., Any], slot: Slot, values: Mapping[str, object]) -> None:
    """`hook(slot, values)` for a hook that takes the values, else `hook(slot)` as hooks always were."""
    await (hook(slot, values) if _takes_values(hook) else hook(slot))


def _takes_values(hook: Callable[..., Any]) -> bool:
    try:
        inspect.signature(hook).bind(None, None)
    except (TypeError, ValueError):  # ValueError: no signature to read; called as hooks always were
        return False
    return True
