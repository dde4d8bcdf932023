"""The API's bearer token: read once at start, required on every route but the probes, metrics and the
dashboard's files, and required at all whenever the API listens beyond loopback."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from aiohttp import web
from aiohttp.typedefs import Handler

from ..errors import ConfigError
from ..settings import api_address, read_token

TOKEN: web.AppKey[str | None] = web.AppKey("token")
OPEN_PATHS = frozenset({"/", "/healthz", "/readyz", "/metrics"})  # and /static/: everything else needs the token
UNAUTHORIZED = {"error": {"code": "unauthorized", "message": "a valid 'Authorization: Bearer <token>' is required"}}


@web.middleware
async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With a token configured every route but the probes, metrics and the dashboard's files needs it;
    one answer for every failure."""
    if request.app[TOKEN] is not None and request.path not in OPEN_PATHS and not request.path.startswith("/static/") \
            and not holds_token(request):
        return web.json_response(UNAUTHORIZED, status=401, headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


def holds_token(request: web.Request) -> bool:
    """Whether the caller presents the API's token (False when none is configured: no caller holds one). Only
    such a caller reads what went wrong inside (a store's failure word for word); any other reads only that
    it failed, and the log has the rest."""
    token = request.app[TOKEN]
    if token is None:
        return False
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    # Digests of equal length: the comparison time says nothing about the token's length either.
    # surrogateescape: a header of non-UTF-8 bytes is just a wrong token, not a 500.
    given = hashlib.sha256(value.strip().encode("utf-8", "surrogateescape")).digest()
    return hmac.compare_digest(given, hashlib.sha256(token.encode()).digest()) and scheme.lower() == "bearer"


def load_token(token_file: str, listen: str) -> str | None:
    """The bearer token, if configured; refuses an off-loopback address without one."""
    token = read_token(token_file)
    if token is None and not _is_local(listen):
        raise ConfigError(f"config: api.token_file is required when api.listen ({listen}) is not loopback")
    return token


def _is_local(listen: str) -> bool:
    address = api_address(listen)
    if isinstance(address, str):  # a unix socket: its file's permissions guard it
        return True
    host = address[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
