"""The browser guard: what a web page the operator happens to open may not do with the API, act on it from
another origin (cross-site request forgery) or reach it under a name of its own (DNS rebinding).

Both matter for a daemon without a token (on loopback: load_token refuses it elsewhere), which serves
any request that reaches its port. A browser sends an `Origin` header with every cross-origin POST,
PATCH or DELETE, even with `mode: "no-cors"` and a body that needs no preflight, so a state-changing
request whose Origin is not the API's own is refused. A rebinding page's requests carry its own host name
in `Host`, so the API answers only requests addressed to a loopback name. With a token neither applies: a
page cannot send the bearer header, and a reverse proxy may pass any Host and Origin.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from ..http.refusals import error

UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def forbidden(message: str) -> web.Response:
    return error(403, "forbidden", message)


def browser_guard() -> Middleware:
    """For an API without a token on loopback TCP (a unix socket is out of a browser's reach)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if host is not None and not _is_loopback_name(host):
            return forbidden(f"Host {host!r} is not a loopback name; without api.token_file this API answers "
                             "only requests to localhost, 127.0.0.1 or [::1]")
        origin = request.headers.get("Origin")
        if request.method in UNSAFE_METHODS and origin is not None and not _same_origin(origin, host):
            return forbidden(f"a request from {origin} may not change anything here (cross-origin)")
        return await handler(request)

    return guard


def _authority(url: str) -> tuple[str, int | None] | None:
    """(host, port as written) of an http(s) URL; None when it is not one."""
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port that is no number or out of range
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.path.strip("/"):
        return None
    return parts.hostname.rstrip("."), port


def _is_loopback_name(host: str) -> bool:
    authority = _authority(f"http://{host}")
    if authority is None:
        return False
    name = authority[0]
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always loopback
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _same_origin(origin: str, host: str | None) -> bool:
    """Whether `origin` (a browser's Origin header; "null" for sandboxed and file pages) is the API's own.
    Ports as written: `https://x` (behind a TLS proxy) is the origin of `Host: x`."""
    if host is None:
        return False
    ours = _authority(f"http://{host}")
    return ours is not None and _authority(origin) == ours


async def no_framing(request: web.Request, response: web.StreamResponse) -> None:
    """No page may frame the dashboard (its cancel and retry buttons could be clicked through a decoy),
    and no answer is sniffed into another content type."""
    response.headers.setdefault("X-Frame-Options", "DENY")
    response.headers.setdefault("Content-Security-Policy", "frame-ancestors 'none'")
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
