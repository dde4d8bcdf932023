"""The /v1/schedules routes: list, save, delete, pause and resume; the body a save carries and the one JSON shape
of a schedule, with the state of the last task or scan it made."""

from __future__ import annotations

from typing import Any, Self

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field
from pydantic.config import JsonDict

from ..http.answers import Answer, Instant, attributes
from ..http.bodies import JsonInt, parse
from ..model import State
from ..scans import ScanState
from ..schedules import MAX_NAME_LEN, NAME_PATTERN, CatchUp, Overlap, Schedule
from .operations import DAEMON, ScheduleView

CRON_SHAPE = r"^(@\S+|\s*\S+(\s+\S+){4}\s*)$"  # five fields, or an @-name as @daily
# A schedule runs by exactly one of its two timings, and submits a task of its type or starts a scan of its
# profile; the other of each pair is left out or null.
_ONE_TIMING: JsonDict = {"allOf": [
    {"oneOf": [{"required": ["cron"], "properties": {"cron": {"type": "string"}}},
               {"required": ["every_s"], "properties": {"every_s": {"type": "number"}}}]},
    {"oneOf": [{"required": ["type"], "properties": {"type": {"type": "string"}}},
               {"required": ["profile"], "properties": {"profile": {"type": "string"}}}]}]}


class ScheduleIn(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_ONE_TIMING)

    name: str = Field(min_length=1, max_length=MAX_NAME_LEN, pattern=NAME_PATTERN)
    type: str | None = Field(None, min_length=1, max_length=200)
    profile: str | None = Field(None, min_length=1, max_length=200, description="start a scan of this profile "
                                "at each tick, instead of a task of `type`")
    payload: dict[str, Any] = {}
    # The document says the shape; the server checks each field too.
    cron: str | None = Field(None, max_length=200, json_schema_extra={"pattern": CRON_SHAPE})
    every_s: float | None = Field(None, ge=1.0, le=366 * 86400)  # sub-second periods overflow the tick arithmetic
    timezone: str = Field("UTC", max_length=100)
    jitter_s: float = Field(0.0, ge=0, le=86400)
    catch_up: CatchUp = "last"
    overlap: Overlap = "allow"
    priority: JsonInt = Field(0, ge=-1_000_000, le=1_000_000)

    def to_schedule(self) -> Schedule:
        return Schedule(**self.model_dump())


class ScheduleOut(Answer):
    name: str
    type: str | None
    profile: str | None = Field(description="a profile schedule starts a scan of it at each tick (type is null)")
    payload: dict[str, Any]
    cron: str | None
    every_s: float | None
    timezone: str
    jitter_s: float
    catch_up: CatchUp
    overlap: Overlap
    priority: int
    config_node: str | None = Field(description="the node whose config file defines it (removing it there "
                                                "removes it); null: defined through the API")
    paused: bool
    next_run_at: Instant | None
    last_run_at: Instant | None
    last_task_id: str | None
    last_task_state: State | None = Field(description="null when it made no task yet, or that task was pruned")
    last_scan_id: str | None = Field(description="a profile schedule's last scan (last_task_id is null then)")
    last_scan_state: ScanState | None = Field(description="null when it started no scan yet, or it was pruned")

    @classmethod
    def of(cls, schedule: Schedule, *, last_task_state: State | None = None,
           last_scan_state: ScanState | None = None) -> Self:
        fields = attributes(schedule)
        if schedule.profile is not None:  # the id a profile schedule keeps of the last thing it started is a scan's
            fields.update(last_task_id=None, last_scan_id=schedule.last_task_id)
        return cls.model_validate({"last_scan_id": None, **fields, "last_task_state": last_task_state,
                                   "last_scan_state": last_scan_state})

    @classmethod
    def of_view(cls, view: ScheduleView) -> Self:
        return cls.of(view.schedule, last_task_state=view.last_task_state, last_scan_state=view.last_scan_state)


class SchedulesOut(Answer):
    schedules: list[ScheduleOut]


async def list_schedules(request: web.Request) -> web.Response:
    views = await request.app[DAEMON].schedules_view()
    return web.json_response({"schedules": [ScheduleOut.of_view(v).to_json() for v in views]})


async def create_schedule(request: web.Request) -> web.Response:
    body = await parse(request, ScheduleIn)
    daemon = request.app[DAEMON]
    saved = await daemon.save_schedule(body.to_schedule())
    return web.json_response(ScheduleOut.of_view(await daemon.schedule_view(saved)).to_json(), status=201)


async def delete_schedule(request: web.Request) -> web.Response:
    await request.app[DAEMON].delete_schedule(request.match_info["name"])
    return web.Response(status=204)


async def pause_schedule(request: web.Request) -> web.Response:
    daemon, paused = request.app[DAEMON], request.match_info["action"] == "pause"
    saved = await daemon.pause_schedule(request.match_info["name"], paused=paused)
    return web.json_response(ScheduleOut.of_view(await daemon.schedule_view(saved)).to_json())
