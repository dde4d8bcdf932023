"""The store: its ports (port.py), what every adapter decides alike (rules.py), their rows (rows.py), the
SQL files' loader (sql.py), what a shared store tells its gateways (notices.py), and open_store(url), which
picks the adapter of a store URL.

The adapters (memory, sqlite, postgres, and remote: a remote worker's gateway) have the same modules, one
per noun of the port. The three that hold the queue own their SQL and schema and pass one contract suite
(tests/store/test_contract.py); the remote one serves the worker side and refuses the queue's verbs,
which are its gateway's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from ..settings.sections import ArtifactSettings, StoreSettings

__all__ = [
    "LEASE_EXPIRED", "SCHEMA_VERSION", "UNWRITTEN_INTERRUPTION", "Acquired", "CancelAnswer", "Ended", "Ending",
    "Enroll", "Expired", "Node", "Page", "PhaseNote", "QueuePort", "Revoked", "Store", "WorkerPort", "open_store",
    "retry_step",
]


def open_store(url: str, *, section: StoreSettings | None = None, artifacts: ArtifactSettings | None = None,
               blob_dir: Path | None = None) -> Store:
    """The adapter for a store URL (not yet opened); a gateway's (https://) takes its certificates from
    `section`. Blobs' bytes go where `artifacts.store` says: "file" (the default on SQLite) keeps them in
    `blob_dir` (node.state_dir/blobs; SQLite's default is beside its file), "postgres" (the default on
    PostgreSQL) in the database; a SQLite queue cannot keep them in PostgreSQL."""
    where = "" if artifacts is None else artifacts.store
    if url.startswith("https://"):
        from .remote import RemoteStore

        if section is None or not section.cert_file or not section.key_file:
            raise ConfigError("config: store.cert_file, store.key_file: a gateway (https://) needs the worker's "
                              "client certificate and key")
        return RemoteStore(url, cert_file=section.cert_file, key_file=section.key_file, ca_file=section.ca_file)
    if url.startswith("sqlite:///"):
        from .sqlite import SqliteStore

        if where == "postgres":
            raise ConfigError("config: artifacts.store: \"postgres\" needs a PostgreSQL store.url; a SQLite store "
                              "keeps blobs in files (\"file\", or leave it empty)")
        return SqliteStore(url.removeprefix("sqlite:///"), blob_dir=blob_dir)
    if url.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresStore

        if where == "file" and blob_dir is None:
            raise ConfigError("config: artifacts.store: \"file\" needs node.state_dir for its blob directory")
        return PostgresStore(url, blob_dir=blob_dir if where == "file" else None)
    if url == "memory://":
        from .memory import MemoryStore

        return MemoryStore()
    from ..settings import redacted_url  # an unknown scheme's URL may still hold a password

    raise ConfigError(f"config: store.url: unsupported URL {redacted_url(url)!r} (use sqlite:///path, "
                      "postgresql://user:pass@host/db, or a gateway's https://host:port)")
