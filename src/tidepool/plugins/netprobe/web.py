"""The web probe of a target's open ports: on each port, TLS first then plain HTTP, and which of them answered."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp
import anyio

from ...errors import InvalidArgument, PluginError
from ..scope import Scope
from .http import http_probe, scoped_connector
from .targets import require_positive, shown, validate_target

SCHEMES = ("https", "http")  # the order a port is tried in: a TLS server never answers plain HTTP usefully


async def probe_web_ports(
    target: str,
    ports: Sequence[int],
    *,
    timeout_s: float = 10.0,
    verify_tls: bool = True,
    concurrency: int = 10,
    scope: Scope | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """GET / on each port of `target`, over TLS and, if TLS got no answer, over plain HTTP.

    Returns (summary, answers). The summary is {"target", "ports": {port: entry}, "web": [ports that
    answered]}, each entry {"scheme": "https" | "http" | None, "url", "status", "server", "errors":
    {scheme: {"code", "message"}}}. `answers` holds, for each port that answered in port order,
    http_probe's whole result plus "port", "scheme" and "server". A certificate that fails verification
    (with `verify_tls`) is a TLS answer without a status: plain HTTP is not tried on that port.
    Each request is bounded by `timeout_s` (a port costs at most twice that); at most `concurrency`
    ports are probed at once. Nothing a port does fails the probe: its entry says what happened. With a
    `scope`, a target outside it fails the probe (TargetRefused) before any connect, and a port whose
    redirects lead outside has an out_of_scope error in its entry.
    """
    target = validate_target(target)
    require_positive("timeout_s", timeout_s)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise InvalidArgument("concurrency", f"must be an integer >= 1, got {shown(concurrency)}")
    if scope is not None:  # refused once, not as an error of every port
        await scope.addresses(target, field="payload.target")
    host = f"[{target}]" if ":" in target else target
    port_list = sorted(set(ports))
    found: dict[int, tuple[dict[str, Any], dict[str, Any] | None]] = {}
    limiter = anyio.CapacityLimiter(concurrency)

    async def probe(port: int) -> None:
        async with limiter:
            found[port] = await _probe_port(session, host, port, timeout_s, verify_tls, scope)

    async with aiohttp.ClientSession(connector=scoped_connector(scope)) as session, anyio.create_task_group() as tg:
        for port in port_list:
            tg.start_soon(probe, port)
    summary = {
        "target": target,
        "ports": {str(port): found[port][0] for port in port_list},
        "web": [port for port in port_list if found[port][0]["status"] is not None],
    }
    answers = [answer for port in port_list if (answer := found[port][1]) is not None]
    return summary, answers


async def _probe_port(
    session: aiohttp.ClientSession, host: str, port: int, timeout_s: float, verify_tls: bool, scope: Scope | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    errors: dict[str, dict[str, str]] = {}
    for scheme in SCHEMES:
        url = f"{scheme}://{host}:{port}/"
        try:
            result = await http_probe(url, timeout_s=timeout_s, verify_tls=verify_tls, session=session, scope=scope)
        except PluginError as exc:
            errors[scheme] = {"code": exc.code, "message": str(exc)}
            if isinstance(exc.__cause__, aiohttp.ClientConnectorCertificateError):
                return _entry(scheme, url, None, None, errors), None  # it speaks TLS; its certificate is refused
            continue
        server = result["headers"].get("server")
        return _entry(scheme, url, result["status"], server, errors), {
            **result, "port": port, "scheme": scheme, "server": server}
    return _entry(None, None, None, None, errors), None


def _entry(scheme: str | None, url: str | None, status: int | None, server: str | None,
           errors: dict[str, dict[str, str]]) -> dict[str, Any]:
    return {"scheme": scheme, "url": url, "status": status, "server": server, "errors": errors}
