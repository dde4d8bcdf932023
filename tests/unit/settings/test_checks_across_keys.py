"""A check across keys names the TIDEPOOL_ variable that set either key, as a check of one key does; the
settings say where this host reaches the daemon and what its ready line tells."""

from __future__ import annotations

import pytest

from tidepool import settings
from tidepool.errors import ConfigError


@pytest.mark.parametrize(("env", "data", "named"), [
    ({"TIDEPOOL_POOL__MAX_WORKERS": "1"}, {}, "TIDEPOOL_POOL__MAX_WORKERS"),
    ({"TIDEPOOL_POOL__MIN_WORKERS": "20"}, {}, "TIDEPOOL_POOL__MIN_WORKERS"),
    ({"TIDEPOOL_LEASE__RENEW_EVERY_S": "20"}, {}, "TIDEPOOL_LEASE__RENEW_EVERY_S"),
    ({"TIDEPOOL_LEASE__DURATION_S": "5"}, {}, "TIDEPOOL_LEASE__DURATION_S"),
])
def test_a_check_across_keys_names_the_variable_that_set_one_of_them(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], data: dict[str, object], named: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as refused:
        settings.parse(data)
    assert f"(from the environment: {named})" in str(refused.value), refused.value


def test_a_check_across_keys_set_in_the_file_names_no_variable() -> None:
    with pytest.raises(ConfigError) as refused:
        settings.parse({"pool": {"min_workers": 4, "max_workers": 2}})
    assert "environment" not in str(refused.value)


@pytest.mark.parametrize(("listen", "url"), [
    ("127.0.0.1:8470", "http://127.0.0.1:8470"), (":8470", "http://127.0.0.1:8470"),
    ("0.0.0.0:9000", "http://127.0.0.1:9000"), ("[::]:9000", "http://[::1]:9000"),
    ("unix:/run/tidepool/api.sock", "unix:/run/tidepool/api.sock"),
])
def test_local_url_is_where_this_host_reaches_what_api_listen_binds(listen: str, url: str) -> None:
    assert settings.local_url(listen) == url


def test_the_ready_summary_names_the_dashboard_types_and_schedules() -> None:
    loaded = settings.parse({"api": {"listen": ":9000"}, "pool": {"task_types": ["s*"]},
                             "schedules": [{"name": "hourly", "type": "sleep", "every_s": 3600}]})
    assert loaded.ready_summary() == "dashboard http://127.0.0.1:9000/, types scan, sleep, schedules hourly"
