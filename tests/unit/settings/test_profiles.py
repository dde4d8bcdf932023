"""Scan profiles in the config: each step a type or a plugin, checked as types are, errors naming the step."""

import pytest

from tidepool import settings
from tidepool.errors import ConfigError
from tidepool.node import startup
from tidepool.settings import ProfileSettings, TypeSettings


def test_a_fresh_node_has_the_discover_profile_and_its_steps_as_types() -> None:
    loaded = settings.parse({})
    assert loaded.all_profiles == {"discover": ProfileSettings(steps=("tcp_connect", "http_probe"))}
    assert loaded.all_types["tcp_connect"] == TypeSettings(plugins=("tcp_connect",))
    assert {"tcp_connect", "http_probe"} <= set(loaded.claimed_types())


def test_a_step_naming_a_plugin_is_a_type_of_that_one_plugin_and_a_type_keeps_its_own_settings() -> None:
    loaded = settings.parse({
        "plugins": {"enrich": {"command": ["echo", "{target}"]}},
        "types": {"slow": {"plugins": ["sleep"], "max_attempts": 1}},
        "profiles": {"web": {"steps": ["slow", "enrich", "noop"], "continue_on_failure": True}}})
    assert loaded.all_types["enrich"] == TypeSettings(plugins=("enrich",))
    assert loaded.all_types["slow"].max_attempts == 1
    assert loaded.all_types["noop"] == settings.BUILTIN_TYPES["noop"]
    assert loaded.all_profiles["web"].continue_on_failure is True
    startup.check_startable(loaded)  # the registry builds every step's type


@pytest.mark.parametrize(("profiles", "more", "named"), [
    ({"web": {"steps": []}}, {}, r"profiles\.web\.steps: a profile needs at least one step"),
    ({"web": {"steps": ["noop", "nmap"]}}, {},
     r"profiles\.web\.steps\[1\]: 'nmap' is neither a task type nor a plugin"),
    ({"web": {"steps": ["noop", "sleep"]}}, {"plugins": {"deny": ["sleep"]}},
     r"profiles\.web\.steps\[1\]: type 'sleep' runs plugin 'sleep', which plugins.allow/plugins.deny refuse"),
    ({"web": {"steps": ["tcp_connect"]}}, {"plugins": {"allow": ["noop"]}},
     r"profiles\.web\.steps\[0\]: plugin 'tcp_connect' is denied"),
    ({"web": {"steps": ["command"]}}, {}, r"profiles\.web\.steps\[0\]: 'command' is neither"),
    ({"web": {"steps": ["noop"], "continue": True}}, {}, r"unknown key profiles\.web\.continue"),
    ({"web": {"steps": "noop"}}, {}, r"profiles\.web\.steps"),
    ({"show": {"steps": ["noop"]}}, {}, r"profiles\.show: 'show' is a verb of `tidepool scan`"),
])
def test_a_profile_that_cannot_run_is_a_config_error_naming_the_key(profiles: dict[str, object],
                                                                     more: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        settings.parse({"profiles": profiles, **more})


def test_allow_and_deny_leave_out_a_built_in_profile_whose_steps_they_refuse_rather_than_fail() -> None:
    loaded = settings.parse({"plugins": {"deny": ["http_probe"]}})
    assert "discover" not in loaded.all_profiles
    assert "http_probe" not in loaded.all_types and "tcp_connect" not in loaded.all_types


def test_the_config_may_redefine_the_built_in_profile() -> None:
    loaded = settings.parse({"profiles": {"discover": {"steps": ["tcp_connect"]}}})
    assert loaded.all_profiles["discover"].steps == ("tcp_connect",)


def test_profiles_come_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEPOOL_PROFILES", '{"quick": {"steps": ["noop", "noop"]}}')
    assert settings.parse({}).all_profiles["quick"].steps == ("noop", "noop")
