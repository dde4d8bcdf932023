"""A node's start-up checks of the users its commands run as: which refuse it, and naming which key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tidepool import settings
from tidepool.errors import ConfigError
from tidepool.node.startup import keep_private, plugin_registry

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="these run as root, as a daemon that switches users")


def load(tmp_path: Path, text: str) -> settings.Settings:
    path = tmp_path / "tidepool.toml"
    path.write_text(f'[node]\nstate_dir = "{tmp_path / "var"}"\n' + text)
    return settings.load(path)


def test_a_daemon_that_is_not_root_refuses_a_command_user(tmp_path: Path) -> None:
    loaded = load(tmp_path, '[execution]\ncommand_user = "nobody"\n')
    plugin_registry(loaded)  # as root it may
    os.seteuid(65534)
    try:
        with pytest.raises(ConfigError, match=r"^config: execution.command_user: .*only when the daemon runs as root"):
            plugin_registry(loaded)
    finally:
        os.seteuid(0)


@pytest.mark.parametrize(("mode", "group", "refused"), [
    (0o600, 0, False), (0o640, 0, False), (0o644, 0, True), (0o640, 65534, True), (0o604, 0, True)])
def test_a_token_file_the_command_user_could_read_refuses_the_start(tmp_path: Path, mode: int, group: int,
                                                                      refused: bool) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-of-enough-length-0123456789\n")
    os.chown(token, 0, group)
    token.chmod(mode)
    loaded = load(tmp_path, f'[api]\ntoken_file = "{token}"\n[plugins.scan]\ncommand = ["true"]\nuser = "nobody"\n')
    if refused:
        with pytest.raises(ConfigError, match=r"^config: api.token_file: .* is readable by 'nobody'"):
            plugin_registry(loaded)
    else:
        plugin_registry(loaded)


def test_the_state_dir_and_the_sqlite_file_are_kept_to_the_daemon(tmp_path: Path) -> None:
    state = tmp_path / "var"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    loaded = load(tmp_path, "")
    keep_private(loaded)
    db = loaded.db_path()
    assert db is not None
    assert (oct(state.stat().st_mode & 0o777), oct(db.stat().st_mode & 0o777)) == ("0o700", "0o600")
