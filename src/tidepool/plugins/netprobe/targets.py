"""Checking what a probe is pointed at: IP addresses and host names, port lists, URL hosts, positive numbers."""

from __future__ import annotations

import ipaddress
import math
import re

from yarl import URL

from ...errors import InvalidArgument

DEFAULT_PORTS = (80, 443)
MAX_PORT = 65535
MAX_URL_CHARS = 8192

_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_URL_LABEL = r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)"  # URLs also meet container names such as "my_service"
_URL_HOST_NAME = re.compile(rf"{_URL_LABEL}(?:\.{_URL_LABEL})*\.?")
# inet_aton() reads "1.2.3.4.5"-like or "0x7f000001" names as addresses, so a name may not end in one.
_NUMERIC_LABEL = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")
_SCOPE_ID = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63}")  # an interface name or number


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
        f"{shown(value)} is neither an IP address nor a host name "
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
            raise InvalidArgument(field, f"entry {index} ({shown(port)}) is not a port number 1..{MAX_PORT}")
    return list(dict.fromkeys(value))


def parse_url(value: object) -> URL:
    """payload.url as a URL a probe may GET, or InvalidArgument saying why it is not one."""
    if not isinstance(value, str):
        raise InvalidArgument("payload.url", f"must be a string, got {type(value).__name__}")
    if any(char.isspace() or not char.isprintable() for char in value) or len(value) > MAX_URL_CHARS:
        raise InvalidArgument("payload.url", f"{shown(value)} has spaces, control characters or is too long")
    try:
        parsed = URL(value)
    except ValueError as exc:
        raise InvalidArgument("payload.url", f"{shown(value)} is not a valid URL ({exc})") from exc
    problem = url_problem(parsed)
    if problem is not None:
        raise InvalidArgument("payload.url", f"{shown(value)} {problem}")
    return parsed


def url_problem(url: URL) -> str | None:
    """Why `url` may not be probed (nor followed as a redirect's target), or None."""
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


def shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def require_positive(field: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise InvalidArgument(field, f"must be a positive number, got {shown(value)}")
