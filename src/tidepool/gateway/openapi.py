"""The worker protocol as the API's OpenAPI document describes it: each /w1 route's operation, served on
gateway.listen (mutual TLS: the client certificate is the worker's identity), not beside /v1. The node hands
it to the API, which never imports the gateway."""

from __future__ import annotations

from pydantic import BaseModel

from ..http.answers import ArtifactOut
from ..http.openapi import Operation, ServerPaths
from .schemas import (
    REQUESTS,
    AcquireIn,
    AcquireOut,
    ControlOut,
    FinishIn,
    FinishOut,
    LeaseGoneOut,
    PhaseIn,
    PhaseOut,
    RenewIn,
    RenewOut,
    ResultAckOut,
    ResultIn,
)

TAG = "worker protocol"
# Each path names this server: the worker protocol is not served beside /v1.
SERVERS = [{"url": "https://{gateway}", "description": "gateway.listen; a client certificate of "
            "gateway.client_ca_file is required", "variables": {"gateway": {"default": "localhost:8471"}}}]
SAID = {"403": "the registry refuses the worker (worker_pending, worker_revoked) or its certificate names no one",
        "410": "the lease is gone (error.reason: expired, cancelled, revoked, superseded, deadline)",
        "413": "the body is too large, or (a result) the attempt's result quota is reached: result_quota",
        "422": "value_refused: the store refused a value of the body; sent again it would be refused again",
        "429": "the identity holds gateway.max_connections_per_worker connections already (too_many_connections); "
               "this one is closed"}
BODY_ERRORS = ("400", "403", "408", "413", "415", "429", "503")
WRITE_ERRORS = (*BODY_ERRORS, "410", "422")


def _operation(operation_id: str, summary: str, ok: dict[str, type[BaseModel] | None], errors: tuple[str, ...], *,
               body: type[BaseModel] | None = None, media: str = "application/json") -> Operation:
    """A /w1 operation: its own words for a 403 and a 410, and a lost lease's 410 says why (LeaseGoneOut)."""
    return Operation(operation_id, summary, ok, errors, body=body, media=media, said=SAID,
                     error_bodies={"410": LeaseGoneOut})




def _param(name: str, where: str, description: str, pattern: str | None = None, *,
           required: bool = True) -> dict[str, object]:
    schema = {"type": "string", **({"pattern": pattern} if pattern else {})}
    return {"name": name, "in": where, "required": required, "schema": schema, "description": description}


SHA256 = r"^[0-9a-f]{64}$"
BLOB_SAID = {**SAID, "403": "blob_not_leased: no live lease of the worker names this blob as an input (an unknown "
             "blob is answered the same), or the registry refuses the worker",
             "416": "range_not_satisfiable: the Range names no bytes of the blob"}
ARTIFACT_SAID = {**SAID, "400": "a bad name, a missing X-Lease-Token or X-Content-SHA256, or digest_mismatch: the "
                 "body's sha256 is not X-Content-SHA256 (nothing is stored)",
                 "409": "the attempt recorded this name with other bytes",
                 "413": "artifact_quota (the attempt's count or bytes, [artifacts] max_per_attempt and "
                        "max_attempt_bytes) or blob_too_large ([artifacts] max_blob_bytes); nothing is stored"}

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("post", "/w1/acquire"): _operation(
        "acquire", "lease tasks, held up to min(wait_s, gateway.max_wait_s) until one exists",
        {"200": AcquireOut}, BODY_ERRORS, body=AcquireIn),
    ("post", "/w1/renew"): _operation(
        "renew", "extend leases; each is held, to cancel, or lost", {"200": RenewOut},
        WRITE_ERRORS, body=RenewIn),
    ("post", "/w1/phase"): _operation(
        "notePhases", "record phases and progress", {"200": PhaseOut}, WRITE_ERRORS, body=PhaseIn),
    ("post", "/w1/results"): _operation(
        "recordResult", "store a result batch once (200: its key was stored already; 409: with another sha256)",
        {"201": ResultAckOut, "200": ResultAckOut}, (*WRITE_ERRORS, "409"), body=ResultIn),
    ("post", "/w1/finish"): _operation(
        "finish", "end attempts", {"200": FinishOut}, WRITE_ERRORS, body=FinishIn),
    ("get", "/w1/control"): _operation(
        "controlStream", "server-sent events for this worker: cancel, worker, wake", {"200": ControlOut},
        ("403", "429"), media="text/event-stream"),
    ("get", "/w1/blobs/{sha256}"): Operation(
        "getBlob", "an input's bytes (ETag: the sha256; one Range of bytes: 206), for a worker whose live lease "
        "names it", {"200": None, "206": None}, ("400", "403", "416", "429", "503"),
        params=[_param("sha256", "path", "the blob's lowercase hex SHA-256", SHA256),
                _param("Range", "header", "bytes=START-END, START- or -LENGTH", required=False)],
        media="application/octet-stream", said=BLOB_SAID),
    ("put", "/w1/artifacts/{attempt_id}/{name}"): Operation(
        "putArtifact", "record the body (the file's bytes, streamed) as the attempt's artifact NAME once: 201 "
        "recorded, 200 the same bytes were recorded before", {"201": ArtifactOut, "200": ArtifactOut},
        ("400", "403", "408", "409", "410", "413", "429", "503"),
        params=[_param("attempt_id", "path", "the leased attempt"),
                _param("name", "path", "[A-Za-z0-9._-]{1,64}, not . or ..", r"^[A-Za-z0-9._-]{1,64}$"),
                _param("X-Lease-Token", "header", "the attempt's lease token"),
                _param("X-Content-SHA256", "header", "the body's lowercase hex SHA-256", SHA256),
                _param("Content-Type", "header", "kept as the artifact's content_type", required=False)],
        said=ARTIFACT_SAID, error_bodies={"410": LeaseGoneOut}),
}
WORKER_PROTOCOL = ServerPaths(OPERATIONS, REQUESTS, tag=TAG, servers=SERVERS,
                              schemes={"mutualTLS": {"type": "mutualTLS"}})
