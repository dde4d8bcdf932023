"""The worker protocol as the API's OpenAPI document describes it: each /w1 route's operation, served on
gateway.listen (mutual TLS: the client certificate is the worker's identity), not beside /v1. The node hands
it to the API, which never imports the gateway."""

from __future__ import annotations

from pydantic import BaseModel

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
}
WORKER_PROTOCOL = ServerPaths(OPERATIONS, REQUESTS, tag=TAG, servers=SERVERS,
                              schemes={"mutualTLS": {"type": "mutualTLS"}})
