"""Handing a work directory to a command's user: what changes hands, and what never does."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from tidepool.errors import ConfigError
from tidepool.plugins.command.confinement import RunAs, hand_over, run_as
from tidepool.settings import PluginSpec

SOMEONE = RunAs("someone", 54321, 54322, "/nonexistent")  # no such user is needed: root may give a file to any uid


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may give files away")
def test_the_workdir_and_its_files_change_hands_but_nothing_behind_a_link(tmp_path: Path) -> None:
    work, kept = tmp_path / "work", tmp_path / "kept"
    (work / "sub").mkdir(parents=True)
    kept.mkdir()
    (work / "sub" / "input.txt").write_text("in")
    (kept / "blob").write_text("blob")
    os.link(kept / "blob", work / "linked-input")  # an input hard-linked from elsewhere
    (work / "to-kept").symlink_to(kept)
    hand_over(work, SOMEONE)
    for path in (work, work / "sub", work / "sub" / "input.txt", work / "linked-input"):
        info = os.lstat(path)
        assert (info.st_uid, info.st_gid) == (SOMEONE.uid, SOMEONE.gid), path
    assert stat.S_IMODE(work.stat().st_mode) == 0o700
    assert (work / "linked-input").read_text() == "blob"
    assert os.lstat(work / "to-kept").st_uid == SOMEONE.uid  # the link itself
    for path in (kept, kept / "blob"):
        assert os.stat(path).st_uid == 0, path  # what the links lead to stays the daemon's
    assert os.stat(kept / "blob").st_nlink == 1


def test_root_is_no_user_to_run_a_command_as() -> None:
    with pytest.raises(ConfigError, match=r"^config: plugins.x.user: 'root' has uid 0"):
        run_as("root", key="plugins.x.user")


@pytest.mark.parametrize("key", [{"disk_mb": 10}, {"network": "none"}, {"user": "nobody"}])
def test_a_python_plugin_cannot_be_given_what_only_a_command_is_held_to(key: dict[str, object]) -> None:
    with pytest.raises(ValidationError, match="only a command plugin can be held to them"):
        PluginSpec(python="package.module:function", **key)  # type: ignore[arg-type]
