"""Routes of the scans: submit, list, get, cancel, and retry of one job; JSON in and out as every route."""

from __future__ import annotations

from typing import Any, Literal, Self

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ..model import DEFAULT_ORGANIZATION, ORGANIZATION_PATTERN
from ..scans import Scan, ScanState
from . import app as api
from .operations import ScanRequest
from .schemas import CURSOR_PATTERN, MAX_LIST_LIMIT, Instant, JsonInt, Shape, TaskErrorOut

LIST_PARAMETERS = ("state", "profile", "limit", "cursor")


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/scans", submit)
    router.add_get("/v1/scans", list_scans)
    router.add_get("/v1/scans/{id}", get_scan)
    router.add_post("/v1/scans/{id}/cancel", cancel)
    router.add_post("/v1/scans/{id}/jobs/{index}/retry", retry_job)


async def submit(request: web.Request) -> web.Response:
    body = await api.parse(request, SubmitScan)
    scan, created = await request.app[api.DAEMON].scans.submit(
        ScanRequest(body.profile, body.payload, body.priority, body.organization, body.idempotency_key))
    return web.json_response(ScanOut.of(scan).to_json(), status=201 if created else 200)


async def list_scans(request: web.Request) -> web.Response:
    q = api._one_each(request, LIST_PARAMETERS)
    state = None
    if "state" in q:  # present but empty is not "no filter": the document lists the states
        try:
            state = ScanState(q["state"])
        except ValueError:
            raise api.ApiError(400, "invalid_request", f"state: unknown scan state {q['state']!r}; one of "
                               f"{', '.join(s.value for s in ScanState)}") from None
    if q.get("profile") == "":
        raise api.ApiError(400, "invalid_request", "profile: empty; leave the parameter out to list every profile")
    limit = q.get("limit", "50")
    if not (limit.isascii() and limit.isdigit()):  # int() would take "1_0", " 10" and "+10"
        raise api.ApiError(400, "invalid_request", "limit: expected an integer")
    if not 1 <= int(limit) <= MAX_LIST_LIMIT:
        raise api.ApiError(400, "invalid_request", f"limit: must be between 1 and {MAX_LIST_LIMIT}")
    cursor = q.get("cursor") or None
    if cursor is not None and not api.CURSOR.fullmatch(cursor):
        raise api.ApiError(400, "invalid_request", "cursor: pass back a next_cursor of an earlier page")
    page = await request.app[api.DAEMON].scans.list(state=state, profile=q.get("profile"), limit=int(limit),
                                                    cursor=cursor)
    return web.json_response(ScanPageOut(scans=[ScanOut.of(s) for s in page.scans],
                                         next_cursor=page.next_cursor).to_json())


async def get_scan(request: web.Request) -> web.Response:
    scan = await request.app[api.DAEMON].scans.get(request.match_info["id"])
    return web.json_response(ScanOut.of(scan).to_json())


async def cancel(request: web.Request) -> web.Response:
    await api.no_body(request)
    state = await request.app[api.DAEMON].scans.cancel(request.match_info["id"])
    return web.json_response(ScanStateOut(state=state).to_json(), status=202)


async def retry_job(request: web.Request) -> web.Response:
    await api.no_body(request)
    index = request.match_info["index"]
    if not (index.isascii() and index.isdigit()) or len(index) > 6:
        raise api.ApiError(400, "invalid_request", f"index: {index[:40]!r} is not a job's index (0, 1, ...)")
    scan = await request.app[api.DAEMON].scans.retry(request.match_info["id"], int(index))
    return web.json_response(ScanOut.of(scan).to_json(), status=202)


# The HTTP API's scan bodies: what a scan submit may carry, and the one JSON shape of a scan and its jobs.

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
