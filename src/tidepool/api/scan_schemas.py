"""The HTTP API's scan bodies: what a scan submit may carry, and the one JSON shape of a scan and its jobs."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

from ..model import DEFAULT_ORGANIZATION, ORGANIZATION_PATTERN
from ..scans import Scan, ScanState
from .schemas import CURSOR_PATTERN, Instant, JsonInt, Shape, TaskErrorOut

__all__ = ["CURSOR_PATTERN", "JobOut", "ScanOut", "ScanPageOut", "ScanStateOut", "SubmitScan"]

NO_NUL = r"^[^\x00]*$"
# A job's state as a user reads it (the stores keep one more of their own, never shown).
ShownJobState = Literal["waiting", "queued", "running", "success", "failed", "timeout", "cancelled", "skipped"]


class SubmitScan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    profile: str = Field(min_length=1, max_length=200)
    payload: dict[str, Any] = Field(default_factory=dict, description="every step's task gets it, with what the "
                                    "steps before it put in ctx.scope merged over it at the top level")
    priority: JsonInt = Field(0, ge=-1_000_000, le=1_000_000)
    organization: str = Field(DEFAULT_ORGANIZATION, pattern=ORGANIZATION_PATTERN,
                              description="every step's task has it: which remote workers may run them")
    idempotency_key: str | None = Field(None, min_length=1, max_length=512, pattern=NO_NUL)


class JobOut(Shape):
    """One step of a scan: `task_id` is its latest task (null until its step has come)."""

    index: int
    step: str = Field(description="the task type its task runs")
    state: ShownJobState
    task_id: str | None
    attempts: int = Field(description="attempts its latest task has started")
    error: TaskErrorOut | None


class ScanOut(Shape):
    id: str
    profile: str
    state: ScanState
    organization: str
    payload: dict[str, Any]
    scope: dict[str, Any] = Field(description="what its steps learned so far (ctx.scope), merged at the top level")
    jobs: list[JobOut]
    created_at: Instant
    updated_at: Instant
    finished_at: Instant | None

    @classmethod
    def of(cls, scan: Scan) -> Self:
        return cls.model_validate(scan)


class ScanPageOut(Shape):
    scans: list[ScanOut]
    next_cursor: str | None


class ScanStateOut(Shape):
    state: ScanState
