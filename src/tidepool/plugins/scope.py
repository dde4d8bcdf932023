"""The scope: the address blocks (CIDRs) a plugin's targets must lie in, and the check of a target against them.

A target is an IP address, a CIDR block or a host name. An address must be inside one of the blocks, a block
wholly inside one, and a name must resolve only to addresses inside them: one address elsewhere refuses the
name, for a scanner given that name could reach any of its addresses. A name that does not resolve is refused
too, since nothing says where it points.

Names are resolved with the host's resolver (socket.getaddrinfo, the one every program of the host uses) in a
worker thread, so a slow resolver never stalls the event loop, and within `resolve_timeout_s`. Whoever
connects after a check connects to the addresses it returned, never to the name resolved again: a name whose
answer changes between the check and the connect (DNS rebinding) cannot lead it elsewhere.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from ..errors import TargetRefused
from ..settings import SCOPED_BUILTINS, PluginSpec

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
RESOLVE_TIMEOUT_S = 5.0
MAX_TARGETS_PER_FIELD = 4096  # a list field is a list of targets, not a way to make the check resolve forever
Resolved = dict[str, list[str]]  # host name -> its addresses, as one submit found them


@dataclass(frozen=True)
class Scope:
    """The CIDR blocks targets may lie in; `fields` are the payload fields that name targets (may be empty)."""

    networks: tuple[Network, ...]
    fields: tuple[str, ...] = ()
    resolve_timeout_s: float = RESOLVE_TIMEOUT_S

    @classmethod
    def of(cls, cidrs: Iterable[str], fields: Iterable[str] = (), *,
           resolve_timeout_s: float = RESOLVE_TIMEOUT_S) -> Scope:
        return cls(tuple(ipaddress.ip_network(c) for c in cidrs), tuple(fields), resolve_timeout_s)

    def __str__(self) -> str:
        return ", ".join(str(n) for n in self.networks)

    def contains(self, address: Address) -> bool:
        address = _unmapped(address)
        return any(address.version == n.version and address in n for n in self.networks)

    def covers(self, block: Network) -> bool:
        return any(block.version == n.version and block.subnet_of(n) for n in self.networks)  # type: ignore[arg-type]

    async def check_payload(self, payload: Mapping[str, Any], *, resolved: Resolved | None = None) -> None:
        """TargetRefused naming the first field of `fields` that names a target outside the scope. A field the
        payload does not have (or has as null) names no target: there is nothing to check. `resolved` keeps
        the names found so far across the payloads of one batch, each resolved once."""
        for field in self.fields:
            value = payload.get(field)
            if value is not None:
                await self.check_value(value, field=f"payload.{field}", resolved=resolved)

    async def check_value(self, value: object, *, field: str, resolved: Resolved | None = None) -> None:
        """A target, or a list of them (each named `field.INDEX`), checked against the scope."""
        if isinstance(value, list | tuple):
            if len(value) > MAX_TARGETS_PER_FIELD:
                raise TargetRefused(field, f"lists {len(value)} targets; at most {MAX_TARGETS_PER_FIELD} are checked")
            for index, item in enumerate(value):
                await self.check_value(item, field=f"{field}.{index}", resolved=resolved)
            return
        if not isinstance(value, str) or not value:
            raise TargetRefused(field, f"must be a host name, an address or a CIDR block, got {_shown(value)}")
        if "/" in value:
            self._check_block(value, field=field)
        else:
            await self.addresses(value, field=field, resolved=resolved)

    async def addresses(self, host: str, *, field: str, port: int = 0, resolved: Resolved | None = None) -> list[str]:
        """The addresses of `host` (itself if it is one), all inside the scope; else TargetRefused. A caller
        connects to these, never to the name resolved again."""
        literal = _address(host)
        if literal is not None:
            if not self.contains(literal):
                raise TargetRefused(field, f"{host} is outside the scope ({self})")
            return [host]  # as written: an IPv6 zone says which interface reaches it
        found = resolved.get(host) if resolved is not None else None
        if found is None:
            found = await self._resolve(host, field=field, port=port)
            if resolved is not None:
                resolved[host] = found
        outside = [a for a in found if not self.contains(_address(a))]  # type: ignore[arg-type]
        if outside:
            raise TargetRefused(field, f"{host!r} resolves to {', '.join(outside)}, outside the scope ({self})")
        return found

    def _check_block(self, value: str, *, field: str) -> None:
        try:
            block = ipaddress.ip_network(value, strict=False)
        except ValueError:
            raise TargetRefused(field, f"{_shown(value)} is not a CIDR block") from None
        if not self.covers(block):
            raise TargetRefused(field, f"{block} is not wholly inside the scope ({self})")

    async def _resolve(self, host: str, *, field: str, port: int) -> list[str]:
        try:
            with anyio.fail_after(self.resolve_timeout_s):
                infos = await anyio.to_thread.run_sync(_getaddrinfo, host, port, abandon_on_cancel=True)
        except TimeoutError:
            raise TargetRefused(field, f"{host!r} did not resolve within {self.resolve_timeout_s:g}s; "
                                      "its addresses are unknown, so it is refused", retryable=True) from None
        except (socket.gaierror, UnicodeError) as exc:
            temporary = isinstance(exc, socket.gaierror) and exc.errno == socket.EAI_AGAIN
            reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
            raise TargetRefused(field, f"{host!r} does not resolve ({reason}); a name whose addresses are "
                                      "unknown is refused", retryable=temporary) from None
        return list(dict.fromkeys(str(info[4][0]) for info in infos))


# The payload fields the built-in probers connect to (http_probe's payload.url is checked by its host).
PROBER_FIELDS = {"tcp_connect": ("target",), "http_probe": ("target",)}


def plugin_scope(name: str, spec: PluginSpec | None, default: Sequence[str]) -> Scope | None:
    """The scope plugin `name` is held to: its own `scope`, else the node's (`execution.scope`); None when
    there is nothing to hold it to (no scope, or no field naming a target and not a built-in prober)."""
    cidrs = default if spec is None or spec.scope is None else spec.scope
    if not cidrs:
        return None
    if name in SCOPED_BUILTINS and (spec is None or (spec.command is None and spec.python is None)):
        return Scope.of(cidrs, PROBER_FIELDS[name])
    if spec is None or not spec.scope_fields:
        return None
    return Scope.of(cidrs, spec.scope_fields)


def _getaddrinfo(host: str, port: int) -> Sequence[tuple[Any, ...]]:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def _address(value: str) -> Address | None:
    try:
        return ipaddress.ip_address(value.split("%", 1)[0])  # an IPv6 zone names an interface, not an address
    except ValueError:
        return None


def _unmapped(address: Address) -> Address:
    """::ffff:10.1.2.3 reaches 10.1.2.3: it is judged as the IPv4 address it carries."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
