"""The /v1/scans routes: submit, list, get, cancel, and retry of one job; the body a scan submit may carry, and
the one JSON shape of a scan and its jobs."""

from __future__ import annotations

from typing import Any, Literal, Self

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ..http.answers import Answer, Instant, TaskErrorOut
from ..http.bodies import JsonInt, no_body, parse
from ..http.refusals import Refusal
from ..model import DEFAULT_ORGANIZATION, ORGANIZATION_PATTERN
from ..scans import Scan, ScanState
from .blobs import checked_inputs, inputs_field
from .listing import cursor_of, limit_of, one_each
from .operations import DAEMON, ScanRequest

LIST_PARAMETERS = ("state", "profile", "limit", "cursor")
MAX_JOB_INDEX = 999_999  # past any profile's steps: an index beyond a scan's jobs is its 404
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
    inputs: dict[str, str] = inputs_field()


class JobOut(Answer):
    """One step of a scan: `task_id` is its latest task (null until its step has come)."""

    index: int
    step: str = Field(description="the task type its task runs")
    state: ShownJobState
    task_id: str | None
    attempts: int = Field(description="attempts its latest task has started")
    error: TaskErrorOut | None
    artifacts: dict[str, str] = Field(description="its latest task's artifacts: name -> sha256 (the later "
                                      "steps get them as inputs)")


class ScanOut(Answer):
    id: str
    profile: str
    state: ScanState
    organization: str
    payload: dict[str, Any]
    inputs: dict[str, str] = Field(description="as submitted: file name -> sha256; every step's task gets them")
    scope: dict[str, Any] = Field(description="what its steps learned so far (ctx.scope), merged at the top level")
    jobs: list[JobOut]
    created_at: Instant
    updated_at: Instant
    finished_at: Instant | None

    @classmethod
    def of(cls, scan: Scan) -> Self:
        return cls.model_validate(scan)


class ScanPageOut(Answer):
    scans: list[ScanOut]
    next_cursor: str | None


class ScanStateOut(Answer):
    state: ScanState


async def submit(request: web.Request) -> web.Response:
    body = await parse(request, SubmitScan)
    scan, created = await request.app[DAEMON].scans.submit(
        ScanRequest(body.profile, body.payload, body.priority, body.organization, body.idempotency_key,
                    checked_inputs(body.inputs)))
    return web.json_response(ScanOut.of(scan).to_json(), status=201 if created else 200)


async def list_scans(request: web.Request) -> web.Response:
    q = one_each(request, LIST_PARAMETERS)
    state = None
    if "state" in q:  # present but empty is not "no filter": the document lists the states
        try:
            state = ScanState(q["state"])
        except ValueError:
            raise Refusal(400, "invalid_request", f"state: unknown scan state {q['state']!r}; one of "
                          f"{', '.join(s.value for s in ScanState)}") from None
    if q.get("profile") == "":
        raise Refusal(400, "invalid_request", "profile: empty; leave the parameter out to list every profile")
    limit, cursor = limit_of(q), cursor_of(q)
    page = await request.app[DAEMON].scans.list(state=state, profile=q.get("profile"), limit=limit, cursor=cursor)
    return web.json_response(ScanPageOut(scans=[ScanOut.of(s) for s in page.scans],
                                         next_cursor=page.next_cursor).to_json())


async def get_scan(request: web.Request) -> web.Response:
    scan = await request.app[DAEMON].scans.get(request.match_info["id"])
    return web.json_response(ScanOut.of(scan).to_json())


async def cancel(request: web.Request) -> web.Response:
    await no_body(request)
    state = await request.app[DAEMON].scans.cancel(request.match_info["id"])
    return web.json_response(ScanStateOut(state=state).to_json(), status=202)


async def retry_job(request: web.Request) -> web.Response:
    await no_body(request)
    index = request.match_info["index"]
    if not (index.isascii() and index.isdigit()) or len(index) > len(str(MAX_JOB_INDEX)):
        raise Refusal(400, "invalid_request", f"index: {index[:40]!r} is not a job's index (0 to {MAX_JOB_INDEX})")
    scan = await request.app[DAEMON].scans.retry(request.match_info["id"], int(index))
    return web.json_response(ScanOut.of(scan).to_json(), status=202)
