"""The `store` fixture: one opened adapter per parameter (memory, SQLite file, PostgreSQL schema)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tidepool.lifecycle import RetryPolicy
from tidepool.model import AttemptStatus, CertSeen, ClaimFilter, Outcome
from tidepool.store import Store
from tidepool.store.memory import MemoryStore
from tidepool.store.sqlite import SqliteStore

# What the store tests share: a fixed clock origin, the lease, a retry policy, a claim of any type, a success.
T0 = 1_700_000_000.0
LEASE_S = 30.0
POLICY = RetryPolicy(base_s=2.0, max_s=300.0, jitter=0.1, max_interruptions=2)
ANY = ClaimFilter()
SUCCEEDED = Outcome(AttemptStatus.SUCCEEDED)
# A remote worker's identity and two certificates of it, the second the later.
SCANNER = "scanner-1.example"
CERT_1 = CertSeen("a1" * 32, T0 + 86400 * 365)
CERT_2 = CertSeen("b2" * 32, T0 + 86400 * 730)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def kind(request: pytest.FixtureRequest) -> str:
    """Which adapter; a test narrows it with @pytest.mark.parametrize("kind", [...])."""
    return str(request.param)


@pytest.fixture
def adapter(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Store:
    """The adapter, not yet opened."""
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        return SqliteStore(tmp_path / "tidepool.db")
    try:
        from tidepool.store.postgres import PostgresStore
    except ModuleNotFoundError as exc:
        if exc.name != "tidepool.store.postgres":
            raise  # the adapter exists but imports something missing: a bug, not a skip
        request.getfixturevalue("unavailable")("tidepool.store.postgres does not exist yet")
    url, schema = request.getfixturevalue("postgres_schema")
    store: Store = PostgresStore(url, schema=schema)
    return store


@pytest.fixture
async def store(adapter: Store) -> AsyncIterator[Store]:
    await adapter.open()
    try:
        yield adapter
    finally:
        await adapter.close()
