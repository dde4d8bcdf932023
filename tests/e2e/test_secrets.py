"""Secrets stay secret where tidepool prints them: `config check` shows no store password (with an empty
user, an `@` in it, a scheme tidepool does not know) and no plugin env value; `migrate` neither."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import to_toml

Cli = Callable[..., subprocess.CompletedProcess[str]]
SECRET = "TopSecret99"


@pytest.mark.e2e
@pytest.mark.parametrize("url", [f"postgresql://:{SECRET}@127.0.0.1/test", f"postgresql://tp:a@{SECRET}@127.0.0.1/test",
                                 f"postgresql://tp:{SECRET}@127.0.0.1/test?sslpassword={SECRET}"],
                         ids=["empty_user", "at_in_password", "query_too"])
def test_config_check_prints_no_store_password(tmp_path: Path, cli: Cli, url: str) -> None:
    path = tmp_path / "tidepool.toml"
    path.write_text(to_toml({"api": {"listen": "127.0.0.1:18998"}, "store": {"url": url}}))
    result = cli("config", "check", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert json.loads(result.stdout)["store"]["url"].startswith("postgresql://")


@pytest.mark.e2e
def test_a_store_url_of_a_scheme_tidepool_does_not_know_is_refused_without_its_password(tmp_path: Path,
                                                                                         cli: Cli) -> None:
    path = tmp_path / "tidepool.toml"
    path.write_text(to_toml({"api": {"listen": "127.0.0.1:18998"},
                             "store": {"url": f"mysql://root:{SECRET}@db.example/x"}}))
    result = cli("config", "check", "--config", str(path))
    assert result.returncode == 2 and "mysql://root:***@db.example/x" in result.stderr, result.stderr
    assert SECRET not in result.stdout + result.stderr


@pytest.mark.e2e
def test_config_check_prints_plugin_env_values_as_stars(tmp_path: Path, cli: Cli) -> None:
    path = tmp_path / "tidepool.toml"
    path.write_text(to_toml({"api": {"listen": "127.0.0.1:18998"},
                             "store": {"url": f"sqlite:///{tmp_path / 'var' / 't.db'}"}})
                    + f'[plugins.shodan]\ncommand = ["true"]\nenv = {{ SHODAN_KEY = "{SECRET}", MODE = "x" }}\n')
    result = cli("config", "check", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout
    assert json.loads(result.stdout)["plugins"]["defs"]["shodan"]["env"] == {"SHODAN_KEY": "***", "MODE": "***"}
