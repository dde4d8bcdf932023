"""The http_probe probe: GET a URL, follow its redirects, and report the status, headers and TLS facts."""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import aiohttp.abc
import anyio
from multidict import CIMultiDictProxy
from yarl import URL

from ...errors import InvalidArgument, PluginError, TargetRefused
from ..scope import Scope
from .targets import parse_url, require_positive, shown, url_problem
from .tls import RecordingContext, new_ssl_context, tls_facts

BODY_CAP_BYTES = 64 * 1024
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True)
class _Hop:
    """One request of a redirect chain; `next_url` is set when the chain goes on."""

    url: URL
    status: int
    location: str | None
    next_url: URL | None
    headers: dict[str, str]
    body_bytes: int
    tls: dict[str, Any] | None


async def http_probe(
    url: str,
    *,
    timeout_s: float = 10.0,
    max_redirects: int = 10,
    verify_tls: bool = True,
    session: aiohttp.ClientSession | None = None,
    scope: Scope | None = None,
) -> dict[str, Any]:
    """GET `url`, following up to `max_redirects` redirects, and report status, headers and TLS facts.

    `timeout_s` bounds the whole chain; running out raises PluginError "timeout" (retryable), never a
    bare TimeoutError, so a caller's own deadline is not confused with the probe's. Network and TLS
    failures raise PluginError "http_error" (a certificate that fails verification is not retryable),
    a redirect loop "too_many_redirects". The body is read up to BODY_CAP_BYTES and dropped.

    With a `scope`, no request goes to an address outside it: each hop's host (the URL's, then every
    redirect's) is checked before its request, its connection goes only to the addresses that check
    returned (scoped_connector's resolver), and the peer it reached is checked again; a hop outside raises
    TargetRefused (out_of_scope, not retried). A caller's `session` must then be made with scoped_connector.
    """
    start = parse_url(url)
    require_positive("timeout_s", timeout_s)
    if isinstance(max_redirects, bool) or not isinstance(max_redirects, int) or max_redirects < 0:
        raise InvalidArgument("max_redirects", f"must be an integer >= 0, got {shown(max_redirects)}")
    try:
        with anyio.fail_after(timeout_s):
            if session is not None:
                return await _follow(session, url, start, max_redirects, verify_tls, scope)
            async with aiohttp.ClientSession(connector=scoped_connector(scope)) as own_session:
                return await _follow(own_session, url, start, max_redirects, verify_tls, scope)
    except TimeoutError as exc:
        raise PluginError(
            f"http_probe: {url} gave no complete answer within {timeout_s}s", code="timeout"
        ) from exc


async def _follow(
    session: aiohttp.ClientSession, original: str, start: URL, max_redirects: int, verify_tls: bool,
    scope: Scope | None,
) -> dict[str, Any]:
    ssl_context = await new_ssl_context(verify_tls)
    started = time.perf_counter()
    redirects: list[dict[str, Any]] = []
    hop = await _fetch(session, start, ssl_context, scope)
    while hop.next_url is not None:
        if len(redirects) == max_redirects:
            raise PluginError(
                f"http_probe: {original} redirects more than {max_redirects} times "
                f"(last to {hop.location!r}); raise max_redirects or probe the target directly",
                code="too_many_redirects",
                retryable=False,
            )
        redirects.append({"url": str(hop.url), "status": hop.status, "location": hop.location})
        hop = await _fetch(session, hop.next_url, ssl_context, scope, redirected_from=hop.url)
    return {
        "url": original,
        "final_url": str(hop.url),
        "status": hop.status,
        "headers": hop.headers,
        "redirects": redirects,
        "tls": hop.tls,
        "body_bytes": hop.body_bytes,
        "elapsed_s": time.perf_counter() - started,
    }


async def _fetch(session: aiohttp.ClientSession, url: URL, ssl_context: RecordingContext, scope: Scope | None,
                 *, redirected_from: URL | None = None) -> _Hop:
    if scope is not None:
        await _check_hop(scope, url, redirected_from)
    seen = len(ssl_context.created)
    try:
        # "Connection: close": a probe leaves no idle connection behind in a caller's session.
        async with session.get(
            url,
            allow_redirects=False,
            raise_for_status=False,  # a 404 is a fact to report, even if the caller's session raises
            ssl=ssl_context,
            headers={"Connection": "close"},
        ) as response:
            if scope is not None:
                _check_peer(scope, url, response)
            next_url = _redirect_target(url, response)
            location = response.headers.get("Location")
            if next_url is not None:
                return _Hop(url, response.status, location, next_url, {}, 0, None)
            tls = tls_facts(url, ssl_context, seen)
            body_bytes = await _read_capped(response.content, BODY_CAP_BYTES)
            return _Hop(
                url, response.status, location, None, _flat_headers(response.headers), body_bytes, tls
            )
    except TimeoutError:
        raise  # aiohttp's own timeouts are TimeoutErrors too; http_probe reports them as "timeout"
    except aiohttp.ClientError as exc:
        raise _http_error(url, exc) from exc


class ScopedResolver(aiohttp.abc.AbstractResolver):
    """aiohttp's resolver of a scoped probe: a name's addresses, only when every one is inside the scope.
    aiohttp connects to what this returns, so the addresses checked are the addresses connected to."""

    def __init__(self, scope: Scope) -> None:
        self._scope = scope

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[aiohttp.abc.ResolveResult]:
        addresses = await self._scope.addresses(host, field="payload.url", port=port)
        return [{"hostname": host, "host": address, "port": port,
                 "family": socket.AF_INET6 if ":" in address else socket.AF_INET, "proto": 0,
                 "flags": socket.AI_NUMERICHOST} for address in addresses]

    async def close(self) -> None:
        pass


def scoped_connector(scope: Scope | None) -> aiohttp.TCPConnector | None:
    """The connector of a session whose connections stay inside `scope` (None, aiohttp's own, without one).
    No DNS cache: each connection's addresses are those of a check made for it."""
    return None if scope is None else aiohttp.TCPConnector(resolver=ScopedResolver(scope), use_dns_cache=False)


async def _check_hop(scope: Scope, url: URL, redirected_from: URL | None) -> None:
    try:
        await scope.addresses(url.raw_host or "", field="payload.url", port=url.port or 0)
    except TargetRefused as exc:
        if redirected_from is None:
            raise
        raise TargetRefused("payload.url", f"{redirected_from} redirects to {url}, which is not followed: "
                                          f"{str(exc).split(': ', 1)[1]}") from None


def _check_peer(scope: Scope, url: URL, response: aiohttp.ClientResponse) -> None:
    """The address the request actually went to, checked too: whatever the path to it, it must be inside."""
    connection = response.connection
    transport = None if connection is None else connection.transport
    peer = None if transport is None else transport.get_extra_info("peername")
    if peer and not scope.contains(ipaddress.ip_address(str(peer[0]).split("%", 1)[0])):
        raise TargetRefused("payload.url", f"GET {url} reached {peer[0]}, outside the scope ({scope})")


def _redirect_target(url: URL, response: aiohttp.ClientResponse) -> URL | None:
    """The URL a redirect points to, or None when this response ends the chain.

    A Location that is missing, malformed or not http(s) ends the chain: that 3xx is the final answer.
    """
    location = response.headers.get("Location")
    if response.status not in _REDIRECT_STATUSES or not location:
        return None
    try:
        target = url.join(URL(location))
    except ValueError:
        return None
    return target if url_problem(target) is None else None


def _http_error(url: URL, exc: aiohttp.ClientError) -> PluginError:
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return PluginError(
            f"http_probe: the TLS certificate of {url} failed verification ({exc.certificate_error}); "
            "pass verify_tls=false to probe it anyway",
            code="http_error",
            retryable=False,
        )
    return PluginError(f"http_probe: GET {url} failed: {_reason(exc)}", code="http_error")


def _reason(exc: aiohttp.ClientError) -> str:
    """Why a request failed, in words: aiohttp's own text of a failed connect shows its SSL context's repr."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to {exc.host}:{exc.port}: {exc.os_error}"
    return str(exc) or type(exc).__name__


async def _read_capped(content: aiohttp.StreamReader, cap: int) -> int:
    total = 0
    while total < cap:
        chunk = await content.read(cap - total)
        if not chunk:
            break
        total += len(chunk)
    return total


def _flat_headers(headers: CIMultiDictProxy[str]) -> dict[str, str]:
    grouped: dict[str, list[str]] = {}
    for name, value in headers.items():
        grouped.setdefault(name.lower(), []).append(value)
    return {name: ", ".join(values) for name, values in grouped.items()}
