"""What a work directory's disk watch counts: the blocks its files hold, each file once, nothing behind a link."""

from __future__ import annotations

import os
from pathlib import Path

from tidepool.plugins.command.disk import DiskWatch, used_bytes

MIB = 2**20


def write(path: Path, mib: int) -> None:
    path.write_bytes(os.urandom(mib * MIB))


def test_files_in_nested_directories_count_by_the_blocks_they_hold(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    write(tmp_path / "one.bin", 2)
    write(tmp_path / "a" / "b" / "two.bin", 3)
    with (tmp_path / "sparse.bin").open("wb") as f:  # 1 GiB long, one byte written: it takes a block
        f.seek(2**30)
        f.write(b"x")
    assert 5 * MIB <= used_bytes(tmp_path) < 6 * MIB


def test_a_hard_link_counts_once_and_a_symbolic_link_is_never_followed(tmp_path: Path) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    write(work / "data.bin", 4)
    os.link(work / "data.bin", work / "again.bin")
    write(outside / "big.bin", 16)
    (work / "to-file").symlink_to(outside / "big.bin")
    (work / "to-dir").symlink_to(outside)
    assert 4 * MIB <= used_bytes(work) < 5 * MIB


async def test_the_watch_says_over_only_past_its_cap_and_measures_when_due(tmp_path: Path) -> None:
    watch = DiskWatch(tmp_path, cap_mb=3, interval_s=3600.0)
    write(tmp_path / "a.bin", 2)
    assert not await watch.over(now=0.0)
    write(tmp_path / "b.bin", 2)
    assert not await watch.over(now=1.0)  # not due yet: the last measure stands
    assert await watch.over(now=1.0, force=True)
    assert watch.used >= 4 * MIB
