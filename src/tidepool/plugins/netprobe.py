"""Network logic of the tcp_connect and http_probe plugins: target checks, port states, HTTP and TLS facts."""

from __future__ import annotations

import _ssl
import asyncio
import errno
import ipaddress
import math
import re
import socket
import ssl
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import anyio
from multidict import CIMultiDictProxy
from yarl import URL

from tidepool.errors import InvalidArgument, PluginError

__all__ = [
    "BODY_CAP_BYTES",
    "DEFAULT_PORTS",
    "http_probe",
    "tcp_connect",
    "validate_ports",
    "validate_target",
]

DEFAULT_PORTS = (80, 443)
MAX_PORT = 65535
BODY_CAP_BYTES = 64 * 1024
MAX_URL_CHARS = 8192

_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_URL_LABEL = r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)"  # URLs also meet container names such as "my_service"
_URL_HOST_NAME = re.compile(rf"{_URL_LABEL}(?:\.{_URL_LABEL})*\.?")
# inet_aton() reads "1.2.3.4.5"-like or "0x7f000001" names as addresses, so a name may not end in one.
_NUMERIC_LABEL = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")
_SCOPE_ID = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63}")  # an interface name or number

# Errors of our own host (out of descriptors, buffers or ephemeral ports), not facts about the target.
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DN_SHORT_NAMES = {
    "commonName": "CN",
    "countryName": "C",
    "localityName": "L",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "stateOrProvinceName": "ST",
}


# --- validation ------------------------------------------------------------------------------------


def validate_target(value: object, *, field: str = "payload.target") -> str:
    """Return `value` unchanged if it is an IP address or a strict RFC 1123 host name, else refuse it."""
    if not isinstance(value, str):
        raise InvalidArgument(
            field, f"must be a string (IP address or host name), got {type(value).__name__}"
        )
    if not value:
        raise InvalidArgument(field, "must not be empty")
    if _is_ip_address(value) or _is_host_name(value):
        return value
    raise InvalidArgument(
        field,
        f"{_shown(value)} is neither an IP address nor a host name "
        "(letters, digits and inner hyphens in dot-separated labels, at most 253 characters)",
    )


def validate_ports(value: object, *, field: str = "payload.ports") -> list[int]:
    """Return the distinct ports of `value` (a list of at most 65535 ints 1..65535) in first-seen order.

    None means the default [80, 443]; an empty list, bools, strings and floats are refused.
    """
    if value is None:
        return list(DEFAULT_PORTS)
    if not isinstance(value, list | tuple):
        raise InvalidArgument(field, f"must be a list of port numbers, got {type(value).__name__}")
    if not value:
        raise InvalidArgument(field, "must not be empty; omit it to scan the default ports 80 and 443")
    if len(value) > MAX_PORT:
        raise InvalidArgument(field, f"has {len(value)} entries; at most {MAX_PORT} are allowed")
    for index, port in enumerate(value):
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= MAX_PORT:
            raise InvalidArgument(field, f"entry {index} ({_shown(port)}) is not a port number 1..{MAX_PORT}")
    return list(dict.fromkeys(value))


def _is_ip_address(value: str) -> bool:
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return False
    scope = address.scope_id if isinstance(address, ipaddress.IPv6Address) else None
    return scope is None or _SCOPE_ID.fullmatch(scope) is not None


def _is_host_name(value: str, *, pattern: re.Pattern[str] = _HOST_NAME) -> bool:
    if len(value) > 253 or not value.isascii() or pattern.fullmatch(value) is None:
        return False
    last_label = value.rstrip(".").rsplit(".", 1)[-1]
    return _NUMERIC_LABEL.fullmatch(last_label) is None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _require_positive(field: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise InvalidArgument(field, f"must be a positive number, got {_shown(value)}")


# --- tcp_connect -----------------------------------------------------------------------------------


async def tcp_connect(
    target: str, ports: Sequence[int], *, concurrency: int = 100, connect_timeout_s: float = 2.0
) -> dict[str, Any]:
    """Try a TCP connection to each port of `target`; each port is "open", "closed" or "filtered".

    The name is resolved once and the first address getaddrinfo() prefers is scanned (it is in the
    result as "address"). At most `concurrency` connects are in flight; each has its own timeout.
    Raises PluginError "resolve_failed" for a name that does not resolve and "socket_error" when
    this host runs out of sockets or ephemeral ports (a local problem, not a fact about the target).
    """
    target = validate_target(target)
    port_list = sorted(validate_ports(list(ports)))
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise InvalidArgument("concurrency", f"must be an integer >= 1, got {_shown(concurrency)}")
    _require_positive("connect_timeout_s", connect_timeout_s)
    family, address = await _resolve(target)
    states: dict[int, str] = {}
    pending = iter(port_list)
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(min(concurrency, len(port_list))):
                tg.start_soon(_scan_worker, pending, family, address, connect_timeout_s, states)
    except* PluginError as group:
        first = group.exceptions[0]  # one local failure stops the scan; report it, not a group
        raise first from first.__cause__
    return {
        "target": target,
        "address": address,
        "ports": {str(port): states[port] for port in port_list},
        "open": [port for port in port_list if states[port] == "open"],
    }


async def _resolve(target: str) -> tuple[socket.AddressFamily, str]:
    try:
        infos = await anyio.getaddrinfo(target, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PluginError(
            f"tcp_connect: cannot resolve {target!r} ({exc.strerror}); check the name and the resolver",
            code="resolve_failed",
            retryable=exc.errno == socket.EAI_AGAIN,
        ) from exc
    family, _type, _proto, _canonname, sockaddr = infos[0]
    return family, str(sockaddr[0])


async def _scan_worker(
    pending: Iterator[int],
    family: socket.AddressFamily,
    address: str,
    timeout_s: float,
    states: dict[int, str],
) -> None:
    # Workers share one iterator: a fixed number of long-lived coroutines bounds concurrency by design.
    for port in pending:
        states[port] = await _probe_port(family, (address, port), timeout_s)


async def _probe_port(family: socket.AddressFamily, sockaddr: tuple[str, int], timeout_s: float) -> str:
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise _local_error(exc) from exc
    with sock:
        sock.setblocking(False)
        with anyio.move_on_after(timeout_s):
            try:
                await asyncio.get_running_loop().sock_connect(sock, sockaddr)
            except ConnectionRefusedError:
                return "closed"
            except OSError as exc:
                if exc.errno in _LOCAL_ERRNOS:
                    raise _local_error(exc) from exc
                return "filtered"  # unreachable, reset by a firewall, ...
            return "open"
        return "filtered"  # no answer within timeout_s


def _local_error(exc: OSError) -> PluginError:
    return PluginError(
        f"tcp_connect: this host cannot open more connections ({exc}); lower concurrency "
        "or raise the open-files limit",
        code="socket_error",
    )


# --- http_probe ------------------------------------------------------------------------------------


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


class _RecordingContext(ssl.SSLContext):
    """An SSL context that keeps every SSLObject it creates.

    aiohttp releases (and, with "Connection: close", closes) a connection as soon as a short body
    has arrived, so `response.connection` is often None by the time we see the response. The
    SSLObject outlives its transport and still answers version(), cipher() and getpeercert().
    """

    created: list[ssl.SSLObject]

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        sslobj = super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)
        self.created.append(sslobj)
        return sslobj


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
    start = _parse_url(url)
    _require_positive("timeout_s", timeout_s)
    if isinstance(max_redirects, bool) or not isinstance(max_redirects, int) or max_redirects < 0:
        raise InvalidArgument("max_redirects", f"must be an integer >= 0, got {_shown(max_redirects)}")
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


def _parse_url(value: object) -> URL:
    if not isinstance(value, str):
        raise InvalidArgument("payload.url", f"must be a string, got {type(value).__name__}")
    if any(char.isspace() or not char.isprintable() for char in value) or len(value) > MAX_URL_CHARS:
        raise InvalidArgument("payload.url", f"{_shown(value)} has spaces, control characters or is too long")
    try:
        parsed = URL(value)
    except ValueError as exc:
        raise InvalidArgument("payload.url", f"{_shown(value)} is not a valid URL ({exc})") from exc
    problem = _url_problem(parsed)
    if problem is not None:
        raise InvalidArgument("payload.url", f"{_shown(value)} {problem}")
    return parsed


def _url_problem(url: URL) -> str | None:
    if url.scheme not in ("http", "https"):
        return "is not an http:// or https:// URL"
    host = url.raw_host
    if not host or not (_is_ip_address(host) or _is_host_name(host, pattern=_URL_HOST_NAME)):
        return "has no valid host"
    if url.port == 0:
        return "has port 0"
    if url.user is not None or url.password is not None:
        return "carries credentials; they would end up in the result, so they are refused"
    return None


async def _follow(
    session: aiohttp.ClientSession, original: str, start: URL, max_redirects: int, verify_tls: bool
) -> dict[str, Any]:
    ssl_context = await _new_ssl_context(verify_tls)
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


async def _new_ssl_context(verify_tls: bool) -> _RecordingContext:
    # One context per probe, so this probe's SSLObjects are the only ones it records and no pooled
    # connection of another probe is reused. Loading the CA store costs ~50 ms of CPU: off the loop.
    context = await anyio.to_thread.run_sync(_build_ssl_context, verify_tls, abandon_on_cancel=True)
    return context


def _build_ssl_context(verify_tls: bool) -> _RecordingContext:
    context = _RecordingContext(ssl.PROTOCOL_TLS_CLIENT)
    context.created = []
    if verify_tls:
        context.load_default_certs()
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


async def _fetch(session: aiohttp.ClientSession, url: URL, ssl_context: _RecordingContext) -> _Hop:
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
            tls = _tls_facts(url, ssl_context, seen)
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
    return target if _url_problem(target) is None else None


def _http_error(url: URL, exc: aiohttp.ClientError) -> PluginError:
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return PluginError(
            f"http_probe: the TLS certificate of {url} failed verification ({exc.certificate_error}); "
            "pass verify_tls=false to probe it anyway",
            code="http_error",
            retryable=False,
        )
    return PluginError(f"http_probe: GET {url} failed: {exc}", code="http_error")


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


# --- TLS facts -------------------------------------------------------------------------------------


def _tls_facts(url: URL, context: _RecordingContext, seen: int) -> dict[str, Any] | None:
    if url.scheme != "https":
        return None
    sslobj = _sslobject_for(url, context, seen)
    if sslobj is None:
        return None
    cipher = sslobj.cipher()
    facts: dict[str, Any] = {"version": sslobj.version(), "cipher": cipher[0] if cipher else None}
    facts.update(_cert_facts(_peer_cert(sslobj), time.time()))
    return facts


def _sslobject_for(url: URL, context: _RecordingContext, seen: int) -> ssl.SSLObject | None:
    new = context.created[seen:]
    if new:
        return new[-1]
    # A server that ignored "Connection: close" may have served this hop on an earlier connection.
    host = (url.raw_host or "").rstrip(".")
    matching = [obj for obj in context.created if obj.server_hostname == host]
    return matching[-1] if matching else None


def _peer_cert(sslobj: ssl.SSLObject) -> Mapping[str, Any] | None:
    cert = sslobj.getpeercert()
    if cert:
        return cert
    # Without verification OpenSSL keeps the certificate but Python only decodes verified ones.
    der = sslobj.getpeercert(binary_form=True)
    return _decode_der(der) if der else None


def _decode_der(der: bytes) -> Mapping[str, Any] | None:
    # PRIVATE API, used on purpose: `cryptography` is not a dependency and the stdlib has no public
    # DER parser. _ssl._test_decode_cert reads a PEM file and returns the getpeercert() dict. If a
    # Python release drops it, certificate facts of unverified probes become None, nothing breaks.
    decode = getattr(_ssl, "_test_decode_cert", None)
    if decode is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".pem") as pem:
        pem.write(ssl.DER_cert_to_PEM_cert(der))
        pem.flush()
        try:
            decoded: Mapping[str, Any] = decode(pem.name)
        except (ssl.SSLError, OSError, ValueError):
            return None
    return decoded


def _cert_facts(cert: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    facts: dict[str, Any] = dict.fromkeys(("cert_not_after", "cert_days_left", "cert_subject", "cert_issuer"))
    if not cert:
        return facts
    if "notAfter" in cert:
        not_after = ssl.cert_time_to_seconds(cert["notAfter"])
        facts["cert_not_after"] = datetime.fromtimestamp(not_after, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        facts["cert_days_left"] = (not_after - now) / 86400
    facts["cert_subject"] = _distinguished_name(cert.get("subject", ()))
    facts["cert_issuer"] = _distinguished_name(cert.get("issuer", ()))
    return facts


def _distinguished_name(rdns: Sequence[Sequence[tuple[str, str]]]) -> str:
    """("commonName", "x") pairs as OpenSSL prints them: "C=US, O=Example, CN=x"."""
    return ", ".join(f"{_DN_SHORT_NAMES.get(name, name)}={value}" for rdn in rdns for name, value in rdn)
