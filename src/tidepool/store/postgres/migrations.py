"""The schema of a store: its version, and the numbered migrations that bring it to this tidepool's."""

from __future__ import annotations

from importlib import resources

from ...errors import SchemaMismatch
from .. import sql
from .connection import Conn

MIGRATIONS = sql.migrations(__package__)
CLAIM_FUNCTION = resources.files(__package__).joinpath("sql", "claim.sql").read_text(encoding="utf-8")
MIGRATE_TIMEOUT_S = 60.0  # a migration may rewrite a big table: it runs once, at open, not as a store call
MIGRATE_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"


async def migrate(conn: Conn, schema: str, *, to: int, allowed: bool, where: str) -> int:
    """Bring the schema to version `to` (when `allowed`); return the version it had. SchemaMismatch when it
    is newer, or older and not `allowed`."""
    async with conn.transaction():
        if allowed:  # nodes starting together: the first creates, the others wait and find it current
            await conn.execute(MIGRATE_LOCK, f"tidepool.migrate.{schema}")
        version = await schema_version(conn, schema)
        if version > to:
            raise SchemaMismatch(f"store {where} has schema version {version}, newer than this tidepool "
                                 f"understands ({to}): upgrade tidepool")
        if version == to:
            return version
        if not allowed:
            raise SchemaMismatch(f"store {where} has schema version {version}, needs {to}: run `tidepool migrate`")
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(f'SET LOCAL search_path TO "{schema}"')  # what the migrations create goes there
        for v, script in (m for m in MIGRATIONS if version < m[0] <= to):
            await conn.execute(script)
            await conn.execute("INSERT INTO schema_version VALUES ($1, extract(epoch FROM clock_timestamp()))", v)
        await conn.execute(CLAIM_FUNCTION)
    return version


async def schema_version(conn: Conn, schema: str) -> int:
    if await conn.fetchval("SELECT to_regclass($1)", f'"{schema}".schema_version') is None:
        return 0
    return int(await conn.fetchval(f'SELECT coalesce(max(version), 0) FROM "{schema}".schema_version'))
