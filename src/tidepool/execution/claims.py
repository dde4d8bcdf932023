"""Claims: what this node's workers claim, the task types it runs for the tags its free slots carry, and
whether they may claim now.

A claim takes only tasks of a type the node defines and its pool.task_types accepts, and only those
whose required tags a free slot of the node can serve, so that no claimed task waits in prepare for a
slot another claim took. Nothing is claimed while a host guard holds. The pool asks before every claim,
so the filter is cached until the types or the free slots change.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..model import ClaimFilter
from .guards import Guards
from .resources import ResourcePool


class Claims:
    def __init__(self, types: Iterable[str], *, resources: ResourcePool, guards: Guards) -> None:
        self._resources = resources
        self._guards = guards
        self._types: tuple[str, ...] = ()
        self._cached: tuple[int, ClaimFilter] | None = None
        self.configure(types)

    def configure(self, types: Iterable[str]) -> None:
        """The names of the types to claim (at start, and on SIGHUP); the store matches them exactly."""
        self._types = tuple(types)
        self._cached = None

    def filter(self) -> ClaimFilter:
        version = self._resources.version
        if self._cached is None or self._cached[0] != version:
            self._cached = (version, ClaimFilter(self._types, self._resources.free_tag_sets()))
        return self._cached[1]

    def allowed(self) -> bool:
        """Not while a host guard holds, nor on a node whose pool.task_types accepts none of its types (one
        that only takes submits for the fleet)."""
        return self._guards.ok() and bool(self._types)
