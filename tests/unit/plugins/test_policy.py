"""plugins.allow and plugins.deny against the built-in types (noop, sleep, scan)."""

from __future__ import annotations

import pytest

from tidepool import settings
from tidepool.errors import ConfigError
from tidepool.plugins import Registry
from tidepool.plugins.builtin import BUILTINS

ECHO = {"echo": {"command": ["echo", "{text}"]}}


def build_registry(s: settings.Settings) -> Registry:
    """As the daemon builds it at start and `config check` does."""
    return Registry.from_settings(s.plugins, s.all_types, kill_grace_s=s.execution.kill_grace_s)


def test_an_allow_list_of_the_nodes_own_plugins_leaves_the_built_in_types_out() -> None:
    """It was refused: "types.noop.plugins: plugin 'noop' is denied", for types the operator never wrote."""
    s = settings.parse({"plugins": {"allow": ["echo"], **ECHO}, "types": {"echo": {"plugins": ["echo"]}}})
    assert set(s.all_types) == {"echo"}
    registry = build_registry(s)
    assert [p.name for p in registry.plugins_for("echo")] == ["echo"]
    assert not registry.knows_type("noop") and s.claimed_types() == ["echo"]


def test_denying_one_built_in_plugin_leaves_out_the_built_in_types_that_use_it() -> None:
    s = settings.parse({"plugins": {"deny": ["http_probe"]}})
    assert set(s.all_types) == {"noop", "sleep"}
    build_registry(s)


def test_a_type_the_config_writes_with_a_denied_plugin_is_still_refused() -> None:
    s = settings.parse({"plugins": {"allow": ["echo"], **ECHO}, "types": {"noop": {"plugins": ["noop"]}}})
    with pytest.raises(ConfigError, match=r"types\.noop\.plugins.*'noop'.*denied"):
        build_registry(s)


def test_a_schedule_of_a_built_in_type_left_out_names_the_schedule() -> None:
    with pytest.raises(ConfigError, match=r"schedules\.tick\.type"):
        settings.parse({"plugins": {"allow": ["echo"], **ECHO},
                        "schedules": [{"name": "tick", "type": "noop", "every_s": 60}]})


def test_the_settings_name_the_built_in_plugins_as_the_registry_defines_them() -> None:
    """A profile's steps are checked against these names when the config is read, before any registry."""
    assert set(BUILTINS) == settings.BUILTIN_PLUGINS
