"""The /v1/workers routes: the registry of remote workers as an operator sees and changes it (enable, disable,
limits, types, organizations, tags, the CA its identity is bound to, revoke), and the bodies they take and
answer."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ..http.answers import Answer, Instant
from ..http.bodies import integral, no_body, parse
from ..model import RemoteWorker, WorkerChange, WorkerState
from ..settings import MAX_WORKERS
from .operations import DAEMON

Name = Field(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f,]+$")


class WorkerPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: Literal["enabled", "disabled"] | None = Field(None, description="a revoke is POST .../revoke")
    max_concurrent_tasks: Annotated[int, Field(ge=0, le=MAX_WORKERS), BeforeValidator(integral)] | None = None
    task_types: list[str] | None = Field(None, min_length=1, max_length=200, description="globs")
    organizations: list[str] | None = Field(None, max_length=200)
    cancel_removed: bool | None = Field(
        None, description="cancel its active attempts of the organizations it is not assigned; by default done when "
                          "organizations takes some away (false: they run to their end)")
    tags: list[str] | None = Field(None, max_length=200, description="globs of the slot tags that count for it")
    reset_issuer: bool = Field(False, description="the identity binds anew to the CA of its next certificate")
    cancel_running: bool = Field(False, description="with state disabled: cancel its active attempts too")

    def to_change(self) -> WorkerChange:
        return WorkerChange(
            state=None if self.state is None else WorkerState(self.state),
            max_concurrent_tasks=self.max_concurrent_tasks,
            task_types=None if self.task_types is None else tuple(dict.fromkeys(self.task_types)),
            organizations=None if self.organizations is None else tuple(dict.fromkeys(self.organizations)),
            cancel_removed=self.cancel_removed,
            tags=None if self.tags is None else tuple(dict.fromkeys(self.tags)),
            reset_issuer=self.reset_issuer, cancel_running=self.cancel_running)


class CertOut(Answer):
    fingerprint: str = Field(description="SHA-256 of the certificate (DER), lowercase hex")
    not_after: Instant


class WorkerOut(Answer):
    """A remote worker as the registry holds it; `live`: its leased, running and cancelling attempts."""

    id: str
    state: WorkerState
    max_concurrent_tasks: int
    task_types: list[str]
    organizations: list[str]
    slots: list[list[str]] = Field(description="the tag set of each slot it last reported")
    version: str | None
    fingerprints: list[CertOut]
    first_seen: Instant
    last_seen: Instant
    address: str | None
    live: int
    issuer: str | None = Field(description="SHA-256 (lowercase hex) of the CA certificate its identity is bound "
                                           "to; null until its next certificate binds it")
    tags: list[str] = Field(description="globs: the slot tags it reports count only when one matches")

    @classmethod
    def of(cls, worker: RemoteWorker) -> Self:
        return cls.model_validate(worker)


class WorkersOut(Answer):
    workers: list[WorkerOut]


async def list_workers(request: web.Request) -> web.Response:
    workers = await request.app[DAEMON].list_workers()
    return web.json_response({"workers": [WorkerOut.of(w).to_json() for w in workers]})


async def get_worker(request: web.Request) -> web.Response:
    worker = await request.app[DAEMON].get_worker(request.match_info["id"])
    return web.json_response(WorkerOut.of(worker).to_json())


async def patch_worker(request: web.Request) -> web.Response:
    body = await parse(request, WorkerPatch)
    worker = await request.app[DAEMON].change_worker(request.match_info["id"], body.to_change())
    return web.json_response(WorkerOut.of(worker).to_json())


async def revoke_worker(request: web.Request) -> web.Response:
    await no_body(request)
    worker = await request.app[DAEMON].revoke_worker(request.match_info["id"])
    return web.json_response(WorkerOut.of(worker).to_json(), status=202)

