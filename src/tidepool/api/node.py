"""The node's own routes: its pool (GET and a live resize), the fleet of nodes and remote workers, the probes
(/healthz, /readyz), the metrics text and the dashboard's page; the bodies they take and answer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Self

from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ..http.answers import Answer, Instant, attributes
from ..http.bodies import integral, parse
from ..http.refusals import Refusal, hidden_reason
from ..metrics.exporter import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..model import RemoteWorker, WorkerState
from ..settings import MAX_WORKERS
from ..store.port import Node
from .auth import holds_token
from .operations import DAEMON, PoolView

STATIC = Path(__file__).parent / "static"


class PoolPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_workers: Annotated[int, Field(ge=1, le=MAX_WORKERS), BeforeValidator(integral)] | None = None
    max_workers: Annotated[int, Field(ge=1, le=MAX_WORKERS), BeforeValidator(integral)] | None = None
    idle_timeout_s: float | None = Field(None, gt=0)


class GuardsOut(Answer):
    tripped: list[str] = Field(description="the guards below their floor: memory, disk")
    min_free_memory_mb: int
    min_free_disk_mb: int
    free_memory_mb: int | None = Field(description="null until measured, or when the probe failed")
    free_disk_mb: int | None


class ResourceOut(Answer):
    in_use: int
    count: int
    tags: list[str]


class PoolOut(Answer):
    node_id: str
    min_workers: int
    max_workers: int
    idle_timeout_s: float
    workers: int
    busy: int = Field(description="workers running a task")
    baseline: int = Field(description="workers that never retire (min_workers of them)")
    demand: int = Field(description="workers started for a busy pool, retired after idle_timeout_s")
    claiming: bool = Field(description="false while draining or while a host guard is tripped")
    draining: bool
    queue: dict[str, int] = Field(description="tasks by unfinished state, in the whole store")
    guards: GuardsOut
    resources: dict[str, ResourceOut]
    pending_restart: list[str] = Field(description="settings changed by a reload that apply at the next start")
    gateway: bool = Field(description="this node serves remote workers (gateway.listen is set)")

    @classmethod
    def of(cls, view: PoolView, *, gateway: bool) -> Self:
        pool = view.pool
        return cls.model_validate({
            "node_id": view.node_id, "min_workers": pool.min_workers, "max_workers": pool.max_workers,
            "idle_timeout_s": pool.idle_timeout_s, "workers": pool.workers, "busy": pool.busy,
            "baseline": pool.baseline, "demand": pool.demand, "claiming": pool.claiming, "draining": view.draining,
            "queue": view.queue, "guards": view.guards, "resources": view.resources,
            "pending_restart": view.pending_restart, "gateway": gateway})


class NodeOut(Answer):
    """A node of the fleet as the registry holds it; `alive`: heard from within three of its heartbeats."""

    node_id: str
    instance_id: str
    hostname: str
    pid: int
    version: str
    started_at: Instant
    heartbeat_at: Instant
    alive: bool
    stopped_at: Instant | None
    task_types: list[str]
    tags: list[list[str]] = Field(description="the tag set of each of the node's resources")
    max_workers: int
    kind: Literal["node", "remote"] = Field("node", description="remote: a worker a gateway serves (its "
                                            "max_workers is its max_concurrent_tasks, its heartbeat its last call)")

    @classmethod
    def of(cls, node: Node, *, now: float) -> Self:
        return cls.model_validate({**attributes(node), "alive": node.alive(now)})

    @classmethod
    def of_remote(cls, worker: RemoteWorker, *, now: float, heard_within_s: float) -> Self:
        """A remote worker beside the nodes: alive while served and heard from within `heard_within_s`."""
        alive = worker.state in (WorkerState.ENABLED, WorkerState.DISABLED) and now - worker.last_seen <= heard_within_s
        return cls.model_validate({
            "node_id": worker.id, "instance_id": "", "hostname": worker.address or "", "pid": 0,
            "version": worker.version or "", "started_at": worker.first_seen, "heartbeat_at": worker.last_seen,
            "alive": alive, "stopped_at": None, "task_types": list(worker.task_types),
            "tags": [list(s) for s in worker.slots], "max_workers": worker.max_concurrent_tasks, "kind": "remote"})


class NodesOut(Answer):
    nodes: list[NodeOut]


class HealthOut(Answer):
    status: str = Field(description="ok (healthz); ready, or unavailable with a reason (readyz)")
    reason: str | None = Field(None, description="why the node is not ready")


async def get_pool(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    return web.json_response(PoolOut.of(await daemon.pool_view(), gateway=daemon.serves_workers).to_json())


async def patch_pool(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    body = await parse(request, PoolPatch)
    try:
        daemon.resize(**body.model_dump(exclude_none=True))
    except ValueError as exc:
        raise Refusal(400, "invalid_request", str(exc)) from None
    return web.json_response(PoolOut.of(await daemon.pool_view(), gateway=daemon.serves_workers).to_json())


async def list_nodes(request: web.Request) -> web.Response:
    view = await request.app[DAEMON].nodes_view()
    nodes = [NodeOut.of(node, now=view.now).to_json() for node in view.nodes]
    nodes += [NodeOut.of_remote(w, now=view.now, heard_within_s=view.heard_within_s).to_json()
              for w in view.remote_workers]
    return web.json_response({"nodes": nodes})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    reason = await request.app[DAEMON].not_ready_reason()
    if reason:
        shown = reason if holds_token(request) else hidden_reason(reason)  # an open probe: the inside stays in
        return web.json_response({"status": "unavailable", "reason": shown}, status=503)
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    body = await request.app[DAEMON].render_metrics()
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")
