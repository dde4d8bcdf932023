"""The store: its ports (port.py), what every adapter decides alike (rules.py), their rows (rows.py), and
open_store(url), which picks the adapter of a store URL.

Adapters (memory, sqlite, postgres) each own their SQL and schema and pass one contract suite
(tests/store/test_contract.py).
"""

from __future__ import annotations

from ..errors import ConfigError
from .port import (
    Acquired,
    CancelAnswer,
    Ended,
    Ending,
    Enroll,
    Expired,
    Node,
    Page,
    PhaseNote,
    QueuePort,
    Revoked,
    Store,
    WorkerPort,
)
from .rows import SCHEMA_VERSION
from .rules import LEASE_EXPIRED, UNWRITTEN_INTERRUPTION, retry_step

__all__ = [
    "LEASE_EXPIRED", "SCHEMA_VERSION", "UNWRITTEN_INTERRUPTION", "Acquired", "CancelAnswer", "Ended", "Ending",
    "Enroll", "Expired", "Node", "Page", "PhaseNote", "QueuePort", "Revoked", "Store", "WorkerPort", "open_store",
    "retry_step",
]


def open_store(url: str) -> Store:
    """The adapter for a store URL (not yet opened)."""
    if url.startswith("sqlite:///"):
        from .sqlite import SqliteStore

        return SqliteStore(url.removeprefix("sqlite:///"))
    if url.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresStore

        return PostgresStore(url)
    if url == "memory://":
        from .memory import MemoryStore

        return MemoryStore()
    raise ConfigError(f"config: store.url: unsupported URL {url!r} (use sqlite:///path or postgresql://user:pass@host/db)")
