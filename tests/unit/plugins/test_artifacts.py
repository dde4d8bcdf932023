"""A command's artifacts globs: what they match in a real work directory, and what they never reach."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tidepool.plugins.command.artifacts import find_artifacts
from tidepool.settings import PluginSpec


def test_globs_match_files_by_base_name_in_glob_order_and_a_taken_name_is_left_out(tmp_path: Path) -> None:
    (tmp_path / "out" / "deep").mkdir(parents=True)
    for relative in ("report.xml", "out/a.pcap", "out/b.pcap", "out/deep/report.xml", "out/stdout"):
        (tmp_path / relative).write_text(relative)
    found = find_artifacts(tmp_path, ["report.xml", "out/*", "**/report.xml"], taken=["stdout"])
    assert found.files == [("report.xml", (tmp_path / "report.xml").resolve()),
                           ("a.pcap", (tmp_path / "out/a.pcap").resolve()),
                           ("b.pcap", (tmp_path / "out/b.pcap").resolve())]  # out/deep, a folder: no match
    assert sorted(found.refused) == [
        "out/deep/report.xml: another file is the artifact 'report.xml' already",
        "out/stdout: another file is the artifact 'stdout' already",
        "report.xml: another file is the artifact 'report.xml' already",  # `**/` matches the top level too
    ]


def test_a_link_out_of_the_work_directory_the_spool_and_odd_files_are_never_recorded(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    (workdir / ".tidepool").mkdir(parents=True)
    (workdir / ".tidepool" / "stdout").write_text("the runner's")
    secret = tmp_path / "secret"
    secret.write_text("the daemon's")
    (workdir / "leak.txt").symlink_to(secret)
    (workdir / "inside.txt").write_text("ok")
    (workdir / "alias.txt").symlink_to(workdir / "inside.txt")
    (workdir / "bad name.txt").write_text("x")
    found = find_artifacts(workdir, ["*", ".tidepool/*"])
    assert found.files == [("alias.txt", (workdir / "inside.txt").resolve()),
                           ("inside.txt", (workdir / "inside.txt").resolve())]
    assert sorted(found.refused) == [
        ".tidepool/stdout: the runner's own file, not the command's",
        "bad name.txt: an artifact's name must be 1 to 64 of A-Z a-z 0-9 . _ -",
        "leak.txt: a link to a file outside the work directory",
    ]


@pytest.mark.parametrize("pattern", ["/etc/passwd", "../x", "out/../../x", ""])
def test_a_glob_that_could_leave_the_work_directory_is_a_config_error(pattern: str) -> None:
    with pytest.raises(ValidationError, match="relative to the work directory"):
        PluginSpec(command=("true",), artifacts=(pattern,))


def test_a_python_plugin_has_no_artifacts_globs() -> None:
    with pytest.raises(ValidationError, match=r"ctx\.artifact"):
        PluginSpec(python="x:y", artifacts=("report.xml",))
