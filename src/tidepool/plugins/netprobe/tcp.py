"""The tcp_connect probe: the state of each port of a target, found by connecting to it."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import anyio

from ...errors import InvalidArgument, PluginError
from ..scope import Scope
from .targets import require_positive, shown, validate_ports, validate_target

# Errors of our own host (out of descriptors, buffers or ephemeral ports), not facts about the target.
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})


async def tcp_connect(
    target: str, ports: Sequence[int], *, concurrency: int = 100, connect_timeout_s: float = 2.0,
    scope: Scope | None = None,
) -> dict[str, Any]:
    """Try a TCP connection to each port of `target`; each port is "open", "closed" or "filtered".

    The name is resolved once and the first address getaddrinfo() prefers is scanned (it is in the
    result as "address"). At most `concurrency` connects are in flight; each has its own timeout.
    Raises PluginError "resolve_failed" for a name that does not resolve and "socket_error" when
    this host runs out of sockets or ephemeral ports (a local problem, not a fact about the target).

    With a `scope`, the target (every address a name resolves to) must lie inside it, else TargetRefused
    before any connect; the address scanned is one the check returned, never the name resolved again.
    """
    target = validate_target(target)
    port_list = sorted(validate_ports(list(ports)))
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise InvalidArgument("concurrency", f"must be an integer >= 1, got {shown(concurrency)}")
    require_positive("connect_timeout_s", connect_timeout_s)
    family, address = await _resolve(target) if scope is None else await _resolve_inside(target, scope)
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


async def _resolve_inside(target: str, scope: Scope) -> tuple[socket.AddressFamily, str]:
    address = (await scope.addresses(target, field="payload.target"))[0]
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return family, address


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
