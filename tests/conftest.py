"""Fixtures every test directory may use: the PostgreSQL test server, a free port and the
missing-prerequisite policy."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, NoReturn

import pytest

if TYPE_CHECKING:
    import asyncpg

POSTGRES_URL = os.environ.get("TIDEPOOL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _unavailable(reason: str) -> NoReturn:
    # `make test` provides what the suite needs (PostgreSQL is one of this machine's services, the
    # Makefile installs chromium): a missing piece is a broken setup, never a test quietly not run.
    pytest.fail(f"{reason}: this test needs it and does not skip", pytrace=False)


@pytest.fixture
def unavailable() -> Callable[[str], NoReturn]:
    """Call with what is missing: the test fails, naming it."""
    return _unavailable


def free_port() -> int:
    """A loopback TCP port nothing listens on now (the kernel's pick, released at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def postgres_admin() -> asyncpg.Connection:
    """A connection to the test server; without asyncpg or the server, the test fails naming which."""
    try:
        import asyncpg
    except ImportError:
        _unavailable("asyncpg is not installed (pip install asyncpg)")
    try:
        return await asyncpg.connect(POSTGRES_URL, timeout=5)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        _unavailable(f"PostgreSQL at {POSTGRES_URL} is unreachable: {exc}")


async def drop_schema(schema: str) -> None:
    """The test schema `schema` and all it holds, gone (a daemon under test made it)."""
    admin = await postgres_admin()
    try:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await admin.close()


@pytest.fixture
async def postgres_schema() -> AsyncIterator[tuple[str, str]]:
    """(url, schema): a schema name unique to this test, dropped with all it holds afterwards."""
    admin = await postgres_admin()
    schema = "t_" + uuid.uuid4().hex
    try:
        yield POSTGRES_URL, schema
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.close()
