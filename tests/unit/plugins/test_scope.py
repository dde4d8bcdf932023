"""The scope: addresses, CIDR blocks and names judged against a plugin's CIDRs, and the config keys that set it."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from tidepool.errors import ConfigError, TargetRefused
from tidepool.plugins.scope import Scope, plugin_scope
from tidepool.settings import parse

pytestmark = pytest.mark.timeout(30)

SCOPE = Scope.of(["10.0.0.0/8", "192.168.1.0/24", "2001:db8::/32"], ["target"])


@pytest.mark.parametrize(("value", "inside"), [
    ("10.1.2.3", True), ("10.255.255.255", True), ("11.0.0.1", False), ("192.168.1.200", True),
    ("192.168.2.1", False), ("2001:db8::1", True), ("2001:db9::1", False), ("::ffff:10.0.0.1", True),
    ("::ffff:11.0.0.1", False), ("fe80::1%eth0", False),
    ("10.0.0.0/16", True), ("10.0.0.0/8", True), ("10.0.0.0/7", False), ("192.168.1.128/25", True),
    ("192.168.0.0/16", False), ("2001:db8:1::/48", True), ("0.0.0.0/0", False),
])
async def test_an_address_or_block_is_inside_only_when_wholly_inside(value: str, inside: bool) -> None:
    if inside:
        await SCOPE.check_value(value, field="payload.target")
    else:
        with pytest.raises(TargetRefused, match=r"^payload\.target: .*(outside|not wholly inside)") as caught:
            await SCOPE.check_value(value, field="payload.target")
        assert caught.value.code == "out_of_scope" and not caught.value.retryable


async def test_a_list_is_checked_entry_by_entry_and_the_entry_is_named() -> None:
    await SCOPE.check_payload({"target": ["10.0.0.1", "10.0.0.0/24"]})
    with pytest.raises(TargetRefused, match=r"^payload\.target\.2: 8\.8\.8\.8 is outside"):
        await SCOPE.check_payload({"target": ["10.0.0.1", "10.0.0.0/24", "8.8.8.8"]})


@pytest.mark.parametrize("value", [5, {"a": 1}, "", True, "10.0.0.0/33"])
async def test_what_names_no_target_is_refused(value: Any) -> None:
    with pytest.raises(TargetRefused, match=r"^payload\.target: "):
        await SCOPE.check_payload({"target": value})


async def test_a_missing_field_names_no_target() -> None:
    await SCOPE.check_payload({"other": "8.8.8.8"})
    await SCOPE.check_payload({"target": None})


async def test_a_name_must_resolve_only_into_the_scope() -> None:
    """The host's own resolver: localhost is 127.0.0.1 in this machine's /etc/hosts."""
    assert await Scope.of(["127.0.0.0/8"]).addresses("localhost", field="f") == ["127.0.0.1"]
    with pytest.raises(TargetRefused, match=r"^f: 'localhost' resolves to 127\.0\.0\.1, outside the scope "
                                           r"\(127\.0\.0\.2/32\)"):
        await Scope.of(["127.0.0.2/32"]).addresses("localhost", field="f")


async def test_one_address_outside_refuses_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"split.example": ["10.0.0.5", "8.8.4.4"]}
    monkeypatch.setattr(socket, "getaddrinfo", _resolver(answers))
    with pytest.raises(TargetRefused, match=r"'split\.example' resolves to 8\.8\.4\.4, outside"):
        await SCOPE.check_value("split.example", field="payload.target")


async def test_one_batch_resolves_a_name_once(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    answer = _resolver({"web.example": ["10.0.0.7"]})

    def counting(host: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(host)
        return answer(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counting)
    resolved: dict[str, list[str]] = {}
    for _ in range(3):
        await SCOPE.check_payload({"target": "web.example"}, resolved=resolved)
    await SCOPE.check_payload({"target": "web.example"})  # another submit asks again
    assert asked == ["web.example", "web.example"]


async def test_a_name_that_does_not_resolve_is_refused_saying_which() -> None:
    with pytest.raises(TargetRefused, match=r"^payload\.target: 'no-such-host\.invalid' does not resolve"):
        await SCOPE.check_value("no-such-host.invalid", field="payload.target")


async def test_a_resolver_that_hangs_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    release = threading.Event()

    def hang(*args: Any, **kwargs: Any) -> Any:
        release.wait(10)
        raise socket.gaierror(socket.EAI_AGAIN, "gave up")

    monkeypatch.setattr(socket, "getaddrinfo", hang)
    slow = Scope.of(["10.0.0.0/8"], resolve_timeout_s=0.2)
    try:
        with pytest.raises(TargetRefused, match=r"did not resolve within 0\.2s") as caught:
            await slow.check_value("slow.example", field="payload.target")
        assert caught.value.retryable  # the resolver's trouble, not the target's: worth another attempt
    finally:
        release.set()


def _resolver(answers: dict[str, list[str]]) -> Any:
    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port or 0)) for a in answers[host]]
    return getaddrinfo


# the config keys

def test_plugin_scope_defaults_to_the_node_wide_one() -> None:
    settings = parse({"execution": {"scope": ["10.0.0.0/8"]},
                      "plugins": {"scan": {"command": ["nmap", "{target}"], "scope_fields": ["target"]},
                                  "own": {"command": ["x", "{host}"], "scope": ["192.168.0.0/16"],
                                          "scope_fields": ["host"]},
                                  "quiet": {"command": ["true"]},
                                  "tcp_connect": {"scope": ["172.16.0.0/12"]}}})
    defs, default = settings.plugins.defs, settings.execution.scope
    assert plugin_scope("scan", defs["scan"], default) == Scope.of(["10.0.0.0/8"], ["target"])
    assert plugin_scope("own", defs["own"], default) == Scope.of(["192.168.0.0/16"], ["host"])
    assert plugin_scope("quiet", defs["quiet"], default) is None  # names no target: nothing to hold it to
    assert plugin_scope("tcp_connect", defs["tcp_connect"], default) == Scope.of(["172.16.0.0/12"], ["target"])
    assert plugin_scope("http_probe", None, default) == Scope.of(["10.0.0.0/8"], ["target"])
    assert plugin_scope("http_probe", None, ()) is None


@pytest.mark.parametrize(("config", "message"), [
    ({"plugins": {"scan": {"command": ["x"], "scope": ["10.0.0.300/8"], "scope_fields": ["t"]}}},
     r"plugins\.scan\.scope\.0: '10\.0\.0\.300/8' is not a CIDR block"),
    ({"plugins": {"scan": {"command": ["x"], "scope": ["10.0.0.1/8"], "scope_fields": ["t"]}}},
     r"plugins\.scan\.scope\.0: '10\.0\.0\.1/8' is not a CIDR block \(10\.0\.0\.1/8 has host bits set\)"),
    ({"execution": {"scope": ["lan"]}}, r"execution\.scope\.0: 'lan' is not a CIDR block"),
    ({"plugins": {"scan": {"command": ["x"], "scope": []}}}, r"plugins\.scan\.scope: "),
    ({"plugins": {"scan": {"command": ["x", "{target}"], "scope_fields": ["target"]}}},
     r"plugins\.scan\.scope_fields: no scope to check them against; set plugins\.scan\.scope or execution\.scope"),
    ({"plugins": {"scan": {"command": ["x", "{target}"], "scope": ["10.0.0.0/8"]}}},
     r"plugins\.scan\.scope: it holds nothing without scope_fields"),
    ({"plugins": {"scan": {"scope": ["10.0.0.0/8"]}}},
     r"plugins\.scan: set exactly one of command or python \(a table with only a scope is for the built-ins"),
    ({"plugins": {"tcp_connect": {"scope": ["10.0.0.0/8"], "scope_fields": ["target"]}}},
     r"plugins\.tcp_connect: set exactly one of command or python"),
    ({"execution": {"scope": ["10.0.0.0/8"]}, "plugins": {"scan": {"command": ["x"], "scope_fields": ["workdir"]}}},
     r"plugins\.scan\.scope_fields: 'workdir' is not a payload field"),
])
def test_a_bad_scope_is_a_config_error_naming_the_key(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(config)
