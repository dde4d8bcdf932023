"""The migration loader: the files' numbers are the schema versions, so a gap or a number used twice is an error."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidepool.store import sql


@pytest.fixture
def package(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "fake_migrations"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "sql").mkdir()
    sys.path.insert(0, str(tmp_path))
    yield root / "sql"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("fake_migrations", None)


def test_migrations_come_in_the_order_of_their_numbers(package: Path) -> None:
    (package / "002_b.sql").write_text("two")
    (package / "001_a.sql").write_text("one")
    assert sql.migrations("fake_migrations") == [(1, "one"), (2, "two")]


def test_a_gap_in_the_numbers_is_an_error(package: Path) -> None:
    (package / "001_a.sql").write_text("one")
    (package / "003_c.sql").write_text("three")
    with pytest.raises(RuntimeError, match="without a gap"):
        sql.migrations("fake_migrations")


def test_two_migrations_with_one_number_are_an_error_not_one_lost(package: Path) -> None:
    (package / "001_a.sql").write_text("one")
    (package / "002_scans.sql").write_text("scans")
    (package / "002_workers.sql").write_text("workers")
    with pytest.raises(RuntimeError, match="two migrations are numbered 002"):
        sql.migrations("fake_migrations")
