"""The http_probe probe: GET a URL, follow its redirects, and report the status, headers and TLS facts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
from multidict import CIMultiDictProxy
from yarl import URL

from ...errors import InvalidArgument, PluginError
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
) -> dict[str, Any]:
    """GET `url`, following up to `max_redirects` redirects, and report status, headers and TLS facts.

    `timeout_s` bounds the whole chain; running out raises PluginError "timeout" (retryable), never a
    bare TimeoutError, so a caller's own deadline is not confused with the probe's. Network and TLS
    failures raise PluginError "http_error" (a certificate that fails verification is not retryable),
    a redirect loop "too_many_redirects". The body is read up to BODY_CAP_BYTES and dropped.
    """
    start = parse_url(url)
    require_positive("timeout_s", timeout_s)
    if isinstance(max_redirects, bool) or not isinstance(max_redirects, int) or max_redirects < 0:
        raise InvalidArgument("max_redirects", f"must be an integer >= 0, got {shown(max_redirects)}")
    try:
        with anyio.fail_after(timeout_s):
            if session is not None:
                return await _follow(session, url, start, max_redirects, verify_tls)
            async with aiohttp.ClientSession() as own_session:
                return await _follow(own_session, url, start, max_redirects, verify_tls)
    except TimeoutError as exc:
        raise PluginError(
            f"http_probe: {url} gave no complete answer within {timeout_s}s", code="timeout"
        ) from exc


async def _follow(
    session: aiohttp.ClientSession, original: str, start: URL, max_redirects: int, verify_tls: bool
) -> dict[str, Any]:
    ssl_context = await new_ssl_context(verify_tls)
    started = time.perf_counter()
    redirects: list[dict[str, Any]] = []
    hop = await _fetch(session, start, ssl_context)
    while hop.next_url is not None:
        if len(redirects) == max_redirects:
            raise PluginError(
                f"http_probe: {original} redirects more than {max_redirects} times "
                f"(last to {hop.location!r}); raise max_redirects or probe the target directly",
                code="too_many_redirects",
                retryable=False,
            )
        redirects.append({"url": str(hop.url), "status": hop.status, "location": hop.location})
        hop = await _fetch(session, hop.next_url, ssl_context)
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


async def _fetch(session: aiohttp.ClientSession, url: URL, ssl_context: RecordingContext) -> _Hop:
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
