"""Operations, as the OpenAPI document describes a route of either server: its answers by status and the models
that shape them, its errors, its body and parameters; and the routes of a server other than the API's that its
document describes as well (the gateway's /w1, on a listener of its own)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True)
class Operation:
    id: str                     # its operationId
    summary: str
    ok: Mapping[str, type[BaseModel] | None]  # status -> the answer's model (None: no body)
    errors: tuple[str, ...] = ()
    body: type[BaseModel] | None = None
    bytes_body: str | None = None  # the media type of a body of raw bytes (an upload), in place of a model
    params: Sequence[dict[str, Any]] = ()
    open: bool = False          # answered without the token
    route: str | None = None    # the router's path, when one route serves several documented paths
    media: str = "application/json"  # of its answers; another with no model: raw bytes (a download)
    # a field of the answer -> the operations that take it as their parameter of that name
    links: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # an error status -> what it means for this operation, where the document's own words do not fit
    said: Mapping[str, str] = field(default_factory=dict)
    # an error status answered with a body of its own rather than the error body (a lost lease's says why)
    error_bodies: Mapping[str, type[BaseModel]] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerPaths:
    """Routes another server serves, for the API's document: their operations (tagged `tag`), each path naming
    `servers`, its callers proving who they are by `schemes` (the security schemes by name); and the models of
    their bodies, which are among the document's schemas whether or not the node serves these routes."""

    operations: Mapping[tuple[str, str], Operation]
    requests: tuple[type[BaseModel], ...]
    tag: str
    servers: list[dict[str, Any]]
    schemes: Mapping[str, dict[str, Any]]

    def answers(self) -> set[type[BaseModel]]:
        """The models of every answer of its operations, errors of their own included."""
        return {m for op in self.operations.values() for m in (*op.ok.values(), *op.error_bodies.values()) if m}
