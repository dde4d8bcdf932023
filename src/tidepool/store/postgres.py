"""The shared PostgreSQL store: its schema, its SQL, and the grouping of many workers' writes.

Several nodes share one database, so every guarantee lives in the statements themselves: claims
take rows with FOR UPDATE SKIP LOCKED, every worker write carries its fence (attempt id + lease
token + live state + unexpired lease) in its WHERE clause, and the reconciler's passes skip rows
another node holds, so no task is claimed, expired, promoted or cancelled twice. Times are the
caller's `now` (epoch seconds), never the server's clock, so every adapter keeps one contract.

Between nodes: every write that makes tasks claimable (a submit, a retry promotion, an interrupted
attempt back to pending, a schedule firing) also sends NOTIFY on the schema's channel, delivered at
commit; each node LISTENs on one dedicated connection (watch()), which also holds the node's session
advisory lock (one process per node id) and is re-established with backoff after a drop. The
`nodes` table is the registry every node re-saves with its heartbeat.

Driver: asyncpg, chosen by bench/pg_driver.py: with the WAL flush taken out of the figures, it did
1.15-1.8x the claims and 1.5-2.7x the single-row round trips of psycopg 3 (async) on this machine.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
import asyncpg  # type: ignore[import-untyped, unused-ignore]  # typed when asyncpg-stubs is installed
from anyio.abc import TaskStatus

from .. import schedules
from ..errors import (
    ConfigError,
    Conflict,
    LeaseLost,
    QueueFull,
    ScheduleNotFound,
    SchemaMismatch,
    StoreUnavailable,
    TaskCancelling,
    TaskNotFound,
    TidepoolError,
)
from ..lifecycle import Decision, Event, RetryPolicy, decide_end, step
from ..model import (
    CANCELLED_ON_REQUEST,
    Attempt,
    AttemptStatus,
    Claimed,
    ClaimFilter,
    Lease,
    NewTask,
    Outcome,
    Phase,
    ResultBatch,
    State,
    Task,
    TaskError,
    Worker,
    cancel_deadline_error,
    new_id,
    new_token,
)
from ..schedules import Fired, Schedule
from . import (
    SCHEMA_VERSION,
    CancelAnswer,
    Ended,
    Ending,
    Expired,
    Node,
    Page,
    PhaseNote,
    batch_answer,
    cancel_step,
    check_room,
    completable_at_once,
    expiry_outcome,
    progress_text,
    retry_step,
)

I = TypeVar("I")  # noqa: E741  # an item queued for a grouped write
R = TypeVar("R")
Conn = Any  # an asyncpg connection; Any types this module alike with and without asyncpg-stubs

# What the driver raises when the server is away or a statement failed: all become StoreUnavailable.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)
log = logging.getLogger("tidepool.store.postgres")
SESSION_ERRORS: tuple[type[BaseException], ...] = (StoreUnavailable, *DRIVER_ERRORS)
SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
MAX_GROUP = 256  # calls per grouped statement
SWEEP = 500  # rows per reconciler transaction: bounded locks and WAL per step
MAX_CLAIM_GROUPS = 64  # claim filters remembered; tag sets change as resource slots come and go
PING_EVERY_S = 5.0  # the LISTEN connection proves itself this often: a silent network drop is noticed
RECONNECT_MAX_S = 5.0  # backoff ceiling between attempts to re-establish the LISTEN connection
MAX_WAKE = 1000  # a notification's count is a hint; no more wake-ups than this from one
WRITE_RETRY_S = 10.0  # a worker's fenced write (result, finish) is retried this long while the server is away

MIGRATIONS = {
    1: """
CREATE TABLE {s}.schema_version (version integer PRIMARY KEY, applied_at double precision NOT NULL);
CREATE TABLE {s}.tasks (
    id text PRIMARY KEY,
    type text NOT NULL,
    payload text NOT NULL,              -- JSON kept verbatim: jsonb refuses \\u0000, SQLite does not
    priority bigint NOT NULL,
    state text NOT NULL CHECK (state IN ('pending', 'leased', 'running', 'retry_wait', 'cancelling',
                                         'completed', 'failed', 'timed_out', 'cancelled')),
    phase text,
    progress text,
    attempt integer NOT NULL DEFAULT 0,
    attempt_rows integer NOT NULL DEFAULT 0,  -- numbers attempts[] under the row lock, never recounted
    max_attempts integer NOT NULL,
    interruptions integer NOT NULL DEFAULT 0,
    timeout_s double precision,
    required_tags text[] NOT NULL DEFAULT '{{}}',
    idempotency_key text UNIQUE,
    fingerprint text NOT NULL,
    node_id text,
    error text,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    available_at double precision NOT NULL,
    finished_at double precision,
    lease_attempt_id text,
    lease_token text,
    lease_expires_at double precision,
    lease_instance text,
    cancel_requested_at double precision
);
CREATE INDEX tasks_queue ON {s}.tasks (priority DESC, created_at, id)
    WHERE state IN ('pending', 'retry_wait');
CREATE INDEX tasks_leases ON {s}.tasks (lease_expires_at)
    WHERE state IN ('leased', 'running', 'cancelling');
CREATE INDEX tasks_node_leases ON {s}.tasks (node_id) WHERE state IN ('leased', 'running', 'cancelling');
CREATE INDEX tasks_cancelling ON {s}.tasks (cancel_requested_at) WHERE state = 'cancelling';
CREATE INDEX tasks_retry_due ON {s}.tasks (available_at) WHERE state = 'retry_wait';
CREATE INDEX tasks_state ON {s}.tasks (state, id);
CREATE INDEX tasks_type ON {s}.tasks (type, id);
CREATE INDEX tasks_finished ON {s}.tasks (finished_at) WHERE finished_at IS NOT NULL;
CREATE TABLE {s}.attempts (
    id text PRIMARY KEY,
    task_id text NOT NULL,
    number integer NOT NULL,
    node_id text NOT NULL,
    instance_id text NOT NULL,
    worker_id text NOT NULL,
    status text NOT NULL,
    started_at double precision NOT NULL,
    finished_at double precision,
    error text,
    exit_status integer,
    stderr_tail text
);
CREATE INDEX attempts_task ON {s}.attempts (task_id, number);
CREATE TABLE {s}.results (
    idempotency_key text PRIMARY KEY,
    task_id text NOT NULL,
    attempt_id text NOT NULL,
    plugin text NOT NULL,
    sequence integer NOT NULL,
    sha256 text NOT NULL,
    final boolean NOT NULL,
    payload text NOT NULL,
    created_at double precision NOT NULL
);
CREATE INDEX results_task ON {s}.results (task_id, created_at);

-- Leases a run of the queue's head for many claim slots at once (one array element per slot):
-- rows come locked in queue order, number n pairs each with its slot, the attempt rows go in.
-- Sorting is off in here: the queue index gives the order, and the row estimates for these
-- filters are often far too low (a burst of submits after an ANALYZE of an idle queue), on which
-- the planner would sort the whole queue for every claim. jit is off: the penalty costs of a
-- disabled sort would otherwise trigger compilation.
CREATE FUNCTION {s}.claim(
    p_now double precision, p_limit integer, p_attempt_ids text[], p_tokens text[], p_node_ids text[],
    p_instance_ids text[], p_worker_ids text[], p_nows double precision[], p_expires double precision[],
    p_type_patterns text[], p_tag_sets jsonb)
RETURNS TABLE (
    slot bigint, id text, type text, payload text, priority bigint, state text, phase text, progress text,
    attempt integer, max_attempts integer, interruptions integer, timeout_s double precision,
    required_tags text[], idempotency_key text, node_id text, error text, created_at double precision,
    updated_at double precision, available_at double precision, finished_at double precision)
LANGUAGE plpgsql
SET enable_sort = off
SET jit = off
SET search_path = {s}
AS $claim$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH picked AS (
        SELECT t.id, t.priority, t.created_at FROM tasks t
        WHERE t.state IN ('pending', 'retry_wait') AND t.available_at <= p_now
          AND t.attempt < t.max_attempts
          AND (p_type_patterns IS NULL OR t.type ~ ANY(p_type_patterns))
          AND (cardinality(t.required_tags) = 0 OR EXISTS (
              SELECT 1 FROM jsonb_array_elements(p_tag_sets) AS ts(tags)
              WHERE t.required_tags <@ ARRAY(SELECT jsonb_array_elements_text(ts.tags))))
        ORDER BY t.priority DESC, t.created_at, t.id LIMIT p_limit
        FOR NO KEY UPDATE OF t SKIP LOCKED
    ), numbered AS (
        SELECT p.id, row_number() OVER (ORDER BY p.priority DESC, p.created_at, p.id) AS n FROM picked p
    ), slots AS (
        SELECT * FROM unnest(p_attempt_ids, p_tokens, p_node_ids, p_instance_ids, p_worker_ids, p_nows,
                             p_expires)
            WITH ORDINALITY AS s(attempt_id, token, node_id, instance_id, worker_id, now, expires_at, n)
    ), leased AS (
        UPDATE tasks t SET state = 'leased', attempt = t.attempt + 1, attempt_rows = t.attempt_rows + 1,
            node_id = s.node_id, phase = NULL, progress = NULL, error = NULL, updated_at = s.now,
            lease_attempt_id = s.attempt_id, lease_token = s.token, lease_expires_at = s.expires_at,
            lease_instance = s.instance_id
        FROM numbered p JOIN slots s ON s.n = p.n WHERE t.id = p.id
        RETURNING s.n, s.worker_id, t.attempt_rows, t.lease_attempt_id, t.lease_instance, t.id, t.type,
            t.payload, t.priority, t.state, t.phase, t.progress, t.attempt, t.max_attempts,
            t.interruptions, t.timeout_s, t.required_tags, t.idempotency_key, t.node_id, t.error,
            t.created_at, t.updated_at, t.available_at, t.finished_at
    ), started AS (
        INSERT INTO attempts (id, task_id, number, node_id, instance_id, worker_id, status, started_at)
        SELECT l.lease_attempt_id, l.id, l.attempt_rows, l.node_id, l.lease_instance, l.worker_id, 'leased',
            l.updated_at
        FROM leased l
    )
    SELECT l.n, l.id, l.type, l.payload, l.priority, l.state, l.phase, l.progress, l.attempt, l.max_attempts,
        l.interruptions, l.timeout_s, l.required_tags, l.idempotency_key, l.node_id, l.error, l.created_at,
        l.updated_at, l.available_at, l.finished_at
    FROM leased l ORDER BY l.n;
END
$claim$;
""",
    2: """
CREATE TABLE {s}.schedules (
    name text PRIMARY KEY,
    spec text NOT NULL,                 -- schedules.spec_of(): what defines it, as JSON
    paused boolean NOT NULL DEFAULT false,
    next_tick_at double precision,
    next_run_at double precision,
    last_run_at double precision,
    last_task_id text
);
CREATE INDEX schedules_due ON {s}.schedules (next_run_at) WHERE NOT paused;
""",
    3: """
CREATE TABLE {s}.nodes (
    node_id text PRIMARY KEY,
    instance_id text NOT NULL,
    hostname text NOT NULL,
    pid integer NOT NULL,
    version text NOT NULL,
    started_at double precision NOT NULL,
    heartbeat_at double precision NOT NULL,
    heartbeat_s double precision NOT NULL,
    stopped_at double precision,
    task_types text[] NOT NULL,
    tags text NOT NULL,                 -- JSON: the tag set of each resource
    max_workers integer NOT NULL
);

-- Version 3 of the claim: each picked row takes its slot's values by array subscript. Version 1
-- joined the rows to an unnest() of the slots, which the planner (sorting off, tiny estimates) ran
-- as a nested loop re-reading the arrays per row: quadratic in the slots of one grouped claim.
CREATE OR REPLACE FUNCTION {s}.claim(
    p_now double precision, p_limit integer, p_attempt_ids text[], p_tokens text[], p_node_ids text[],
    p_instance_ids text[], p_worker_ids text[], p_nows double precision[], p_expires double precision[],
    p_type_patterns text[], p_tag_sets jsonb)
RETURNS TABLE (
    slot bigint, id text, type text, payload text, priority bigint, state text, phase text, progress text,
    attempt integer, max_attempts integer, interruptions integer, timeout_s double precision,
    required_tags text[], idempotency_key text, node_id text, error text, created_at double precision,
    updated_at double precision, available_at double precision, finished_at double precision)
LANGUAGE plpgsql
SET enable_sort = off
SET jit = off
SET search_path = {s}
AS $claim$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH picked AS (
        SELECT t.id, t.priority, t.created_at FROM tasks t
        WHERE t.state IN ('pending', 'retry_wait') AND t.available_at <= p_now
          AND t.attempt < t.max_attempts
          AND (p_type_patterns IS NULL OR t.type ~ ANY(p_type_patterns))
          AND (cardinality(t.required_tags) = 0 OR EXISTS (
              SELECT 1 FROM jsonb_array_elements(p_tag_sets) AS ts(tags)
              WHERE t.required_tags <@ ARRAY(SELECT jsonb_array_elements_text(ts.tags))))
        ORDER BY t.priority DESC, t.created_at, t.id LIMIT p_limit
        FOR NO KEY UPDATE OF t SKIP LOCKED
    ), numbered AS (
        SELECT p.id, row_number() OVER (ORDER BY p.priority DESC, p.created_at, p.id)::integer AS n FROM picked p
    ), leased AS (
        UPDATE tasks t SET state = 'leased', attempt = t.attempt + 1, attempt_rows = t.attempt_rows + 1,
            node_id = p_node_ids[p.n], phase = NULL, progress = NULL, error = NULL, updated_at = p_nows[p.n],
            lease_attempt_id = p_attempt_ids[p.n], lease_token = p_tokens[p.n], lease_expires_at = p_expires[p.n],
            lease_instance = p_instance_ids[p.n]
        FROM numbered p WHERE t.id = p.id
        RETURNING p.n, p_worker_ids[p.n] AS worker_id, t.attempt_rows, t.lease_attempt_id, t.lease_instance, t.id,
            t.type, t.payload, t.priority, t.state, t.phase, t.progress, t.attempt, t.max_attempts,
            t.interruptions, t.timeout_s, t.required_tags, t.idempotency_key, t.node_id, t.error,
            t.created_at, t.updated_at, t.available_at, t.finished_at
    ), started AS (
        INSERT INTO attempts (id, task_id, number, node_id, instance_id, worker_id, status, started_at)
        SELECT l.lease_attempt_id, l.id, l.attempt_rows, l.node_id, l.lease_instance, l.worker_id, 'leased',
            l.updated_at
        FROM leased l
    )
    SELECT l.n::bigint, l.id, l.type, l.payload, l.priority, l.state, l.phase, l.progress, l.attempt,
        l.max_attempts, l.interruptions, l.timeout_s, l.required_tags, l.idempotency_key, l.node_id, l.error,
        l.created_at, l.updated_at, l.available_at, l.finished_at
    FROM leased l ORDER BY l.n;
END
$claim$;
""",
}

# Statements run with search_path set to the store's schema on every pooled connection.

TASK_COLUMNS = (
    "id, type, payload, priority, state, phase, progress, attempt, max_attempts, interruptions, "
    "timeout_s, required_tags, idempotency_key, node_id, error, created_at, updated_at, "
    "available_at, finished_at"
)
ATTEMPTS = """ARRAY(
    SELECT ROW(a.id, a.task_id, a.number, a.node_id, a.worker_id, a.status, a.started_at, a.finished_at,
               a.error, a.exit_status, a.stderr_tail)
    FROM attempts a WHERE a.task_id = t.id ORDER BY a.number)"""
RESULTS = """ARRAY(
    SELECT ROW(r.plugin, r.sequence, r.idempotency_key, r.sha256, r.final, r.payload, r.attempt_id)
    FROM results r WHERE r.task_id = t.id ORDER BY r.created_at, r.sequence)"""
GET = f"SELECT {TASK_COLUMNS}, {ATTEMPTS}, {RESULTS} FROM tasks t WHERE id = $1"
INSERT_MANY = """
INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags,
                   idempotency_key, fingerprint, created_at, updated_at, available_at)
VALUES ($1, $2, $3, $4, 'pending', $5, $6, $7, $8, $9, $10, $10, $11)"""
# The channel is a setting of every connection of this store (see PostgresStore.open): no schema object
# is needed to notify, and the statements stay the same for every schema.
NOTIFY = "SELECT pg_notify(current_setting('tidepool.channel'), $1)"
INSERT = (
    f"{INSERT_MANY}\nON CONFLICT (idempotency_key) DO NOTHING "
    f"RETURNING {TASK_COLUMNS}, pg_notify(current_setting('tidepool.channel'), '1')"
)
QUEUED = """
SELECT count(*) FROM (SELECT 1 FROM tasks WHERE state IN ('pending', 'retry_wait') LIMIT $1) AS q"""

CLAIM = "SELECT * FROM claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"

# Multi-row fenced writes take the leases as parallel arrays ($1..$3 plus extra columns) and lock
# their rows in id order first: two of them over the same tasks (a renewal racing a grouped
# completion) then queue behind each other instead of deadlocking.
LEASES = "unnest($1::text[], $2::text[], $3::text[]{types}) AS l(id, attempt_id, token{names})"
# `state || ''` keeps the planner on the primary key: the statistics of a busy queue are always stale,
# and on them it would scan the whole state index (every row that was ever leased) for a few leases.
FENCED = """
    SELECT t.id{cols} FROM tasks t
    JOIN l ON t.id = l.id AND t.lease_attempt_id = l.attempt_id AND t.lease_token = l.token
    WHERE (t.state || '') IN ('leased', 'running') AND t.lease_expires_at > {now}
    ORDER BY t.id FOR NO KEY UPDATE OF t"""
RENEW = f"""
WITH l AS (SELECT * FROM {LEASES.format(types="", names="")}),
locked AS MATERIALIZED ({FENCED.format(cols="", now="$4")})
UPDATE tasks t SET lease_expires_at = $5 FROM locked WHERE t.id = locked.id
RETURNING t.lease_attempt_id"""
SET_PHASE = f"""
WITH l AS (SELECT * FROM {LEASES.format(types=", $4::text[], $5::text[]", names=", phase, progress")}),
locked AS MATERIALIZED ({FENCED.format(cols=", l.phase, l.progress", now="$6")}),
noted AS (
    UPDATE tasks t SET phase = locked.phase, progress = coalesce(locked.progress, t.progress),
        updated_at = $6, state = 'running'
    FROM locked WHERE t.id = locked.id RETURNING t.lease_attempt_id
), started AS (
    UPDATE attempts a SET status = 'running' FROM noted
    WHERE a.id = noted.lease_attempt_id AND a.status = 'leased'
)
SELECT lease_attempt_id FROM noted"""
COMPLETE = f"""
WITH l AS (SELECT * FROM {LEASES.format(types=", $4::float8[], $5::text[]", names=", now, progress")}),
locked AS MATERIALIZED ({FENCED.format(cols=", l.now, l.progress", now="l.now")}),
done AS (
    UPDATE tasks t SET state = 'completed', phase = NULL, progress = coalesce(locked.progress, t.progress),
        error = NULL, updated_at = locked.now, finished_at = locked.now, lease_token = NULL
    FROM locked WHERE t.id = locked.id RETURNING t.lease_attempt_id, locked.now
), succeeded AS (
    UPDATE attempts a SET status = 'succeeded', finished_at = done.now FROM done
    WHERE a.id = done.lease_attempt_id
)
SELECT lease_attempt_id FROM done"""
CANCELLING = f"""
SELECT l.attempt_id FROM {LEASES.format(types="", names="")}
JOIN tasks t ON t.id = l.id AND t.lease_attempt_id = l.attempt_id AND t.lease_token = l.token
WHERE t.state = 'cancelling'"""
WHY_LOST = "SELECT state FROM tasks WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3"
# FOR SHARE holds off an expiry or a cancel until the result is in, or sees theirs first.
RECORD_RESULT = """
WITH fenced AS (
    SELECT id FROM tasks WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3
      AND state IN ('leased', 'running') AND lease_expires_at > $4
    FOR SHARE
), stored AS (
    INSERT INTO results (idempotency_key, task_id, attempt_id, plugin, sequence, sha256, final, payload,
                         created_at)
    SELECT $5, id, $2, $6, $7, $8, $9, $10, $4 FROM fenced
    ON CONFLICT (idempotency_key) DO NOTHING RETURNING 1
)
SELECT (SELECT count(*) FROM fenced), (SELECT count(*) FROM stored)"""
EARLIER_RESULT = """
SELECT plugin, sequence, idempotency_key, sha256, final, payload, attempt_id FROM results WHERE idempotency_key = $1"""
ENDING_ROW = """
SELECT state, attempt, max_attempts, interruptions, lease_expires_at FROM tasks
WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3 FOR NO KEY UPDATE"""
# How attempts ended, decided in Python (lifecycle.decide_end), written for many at once.
WRITE_ENDS = """
WITH e AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int[],
                         $7::float8[], $8::float8[], $9::int[], $10::text[], $11::text[])
        AS e(task_id, attempt_id, state, status, error, uncount, available_at, finished_at, exit_status,
             stderr_tail, progress)
), ended AS (
    UPDATE attempts a SET status = e.status, finished_at = $12, error = e.error,
        exit_status = e.exit_status, stderr_tail = e.stderr_tail
    FROM e WHERE a.id = e.attempt_id
)
UPDATE tasks t SET state = e.state, phase = NULL, progress = coalesce(e.progress, t.progress), error = e.error,
    updated_at = $12,
    attempt = t.attempt - e.uncount, interruptions = t.interruptions + e.uncount,
    available_at = coalesce(e.available_at, t.available_at), finished_at = e.finished_at,
    lease_token = NULL
FROM e WHERE t.id = e.task_id"""
EXPIRING = f"""
SELECT state, attempt, max_attempts, interruptions, id, lease_attempt_id, lease_token, type FROM tasks
WHERE state IN ('leased', 'running', 'cancelling') AND {{where}}
LIMIT {SWEEP} FOR NO KEY UPDATE SKIP LOCKED"""
PROMOTE = """
WITH due AS (
    SELECT id FROM tasks WHERE state = 'retry_wait' AND available_at <= $1 FOR NO KEY UPDATE SKIP LOCKED
), promoted AS (
    UPDATE tasks t SET state = $2, updated_at = $1 FROM due WHERE t.id = due.id RETURNING t.id
)
SELECT count(*), CASE WHEN count(*) > 0 THEN pg_notify(current_setting('tidepool.channel'), count(*)::text) END
FROM promoted"""
FINISH_CANCELS = f"""
WITH due AS (
    SELECT id, lease_attempt_id FROM tasks WHERE state = 'cancelling' AND cancel_requested_at <= $1
    LIMIT {SWEEP} FOR NO KEY UPDATE SKIP LOCKED
), ended AS (
    UPDATE attempts a SET status = 'cancelled', finished_at = $2, error = $3
    FROM due WHERE a.id = due.lease_attempt_id
)
UPDATE tasks t SET state = $4, phase = NULL, error = $3, finished_at = $2, updated_at = $2, lease_token = NULL
FROM due WHERE t.id = due.id RETURNING t.id, t.type"""
QUEUED_TAG_SETS = """
SELECT DISTINCT required_tags FROM tasks WHERE state IN ('pending', 'retry_wait') AND cardinality(required_tags) > 0"""
# Equal as sets: each array contains the other. The row lock and the state test keep a task failed once.
FAIL_UNSERVICEABLE = f"""
WITH due AS (
    SELECT id FROM tasks
    WHERE state IN ('pending', 'retry_wait') AND required_tags @> $1::text[] AND required_tags <@ $1::text[]
    LIMIT {SWEEP} FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE tasks t SET state = $2, phase = NULL, error = $3, finished_at = $4, updated_at = $4
FROM due WHERE t.id = due.id RETURNING t.id, t.type"""
PRUNE = f"""
WITH old AS (
    SELECT id FROM tasks
    WHERE finished_at < $1 AND state IN ('completed', 'failed', 'timed_out', 'cancelled')
    LIMIT {SWEEP} FOR UPDATE SKIP LOCKED
), r AS (
    DELETE FROM results WHERE task_id IN (SELECT id FROM old)
), a AS (
    DELETE FROM attempts WHERE task_id IN (SELECT id FROM old)
), t AS (
    DELETE FROM tasks WHERE id IN (SELECT id FROM old) RETURNING 1
)
SELECT count(*) FROM t"""
PRUNE_NODES = "DELETE FROM nodes WHERE heartbeat_at < $1"
NODE_COLUMNS = (
    "node_id, instance_id, hostname, pid, version, started_at, heartbeat_at, heartbeat_s, stopped_at, "
    "task_types, tags, max_workers"
)
SAVE_NODE = f"""
INSERT INTO nodes ({NODE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
ON CONFLICT (node_id) DO UPDATE SET instance_id = $2, hostname = $3, pid = $4, version = $5, started_at = $6,
    heartbeat_at = $7, heartbeat_s = $8, stopped_at = $9, task_types = $10, tags = $11, max_workers = $12"""
NODE_LOCK = "SELECT pg_try_advisory_lock(hashtextextended($1, 0))"
TERMINAL_SQL = "state IN ('completed', 'failed', 'timed_out', 'cancelled')"
SCHEDULE_COLUMNS = "name, spec, paused, next_tick_at, next_run_at, last_run_at, last_task_id"
SAVE_SCHEDULE = """
INSERT INTO schedules (name, spec, paused, next_tick_at, next_run_at, last_run_at, last_task_id)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (name) DO UPDATE SET spec = $2, paused = $3, next_tick_at = $4, next_run_at = $5,
    last_run_at = $6, last_task_id = $7"""
# Due schedules, each fired in a transaction of its own; a node skips the ones another is firing.
DUE_SCHEDULE = f"""
SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE name = $1 AND NOT paused AND next_run_at <= $2
FOR UPDATE SKIP LOCKED"""


class PostgresStore:
    """The store of a fleet. `schema` (else the URL's `?schema=NAME`, else "tidepool") holds its tables,
    so several fleets or test runs can share one database."""

    def __init__(
        self,
        url: str,
        *,
        schema: str | None = None,
        max_connections: int = 10,
        command_timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        url, url_schema = _split_schema(url)
        schema = schema or url_schema or "tidepool"
        if not SCHEMA_NAME.fullmatch(schema):
            raise ConfigError(f"config: store schema {schema!r} is not a plain SQL name (letters, digits, _)")
        self.url = url
        self.schema = schema
        self.channel = channel_for(schema)
        self._max_connections = max_connections
        self._command_timeout_s = command_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._pool: Any = None
        self._claims: dict[ClaimFilter, _Group[_ClaimCall, list[Claimed]]] = {}
        self._completions = _Group(self._complete_group)
        parts = urlsplit(url)  # for messages: never the password
        self._where = f"{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path} schema {schema}"
        self._settings = {
            "search_path": f'"{schema}"',
            "application_name": f"tidepool {schema}",
            "tidepool.channel": self.channel,
            "jit": "off",  # JIT costs more than these small statements
        }
        self._session: Conn | None = None  # the dedicated connection: node lock and LISTEN
        self._node: tuple[str, str] | None = None  # (node_id, instance_id) once lock_node() took it
        self._node_locked = False  # the current session holds the node lock
        self._lock_missing_said = False

    # lifecycle of the adapter

    async def open(self, *, migrate: bool = True) -> int:
        try:
            pool = await asyncpg.create_pool(
                self.url,
                min_size=0,  # no floor to restore: during an outage asyncpg would retry it every second
                max_size=self._max_connections,
                timeout=self._connect_timeout_s,
                command_timeout=self._command_timeout_s,
                server_settings=self._settings,
            )
        except DRIVER_ERRORS as exc:
            raise StoreUnavailable(f"store {self._where}: cannot connect: {_said(exc)}") from exc
        try:
            async with pool.acquire() as conn:
                found = await self._migrate(conn, migrate)
        except DRIVER_ERRORS as exc:
            pool.terminate()
            raise StoreUnavailable(f"store {self._where}: {_said(exc)}") from exc
        except BaseException:
            pool.terminate()
            raise
        self._pool = pool
        return found

    async def close(self) -> None:
        await self._completions.drain()
        for group in list(self._claims.values()):
            await group.drain()  # writes already queued still go out
        session, self._session = self._session, None
        if session is not None:  # ends the node lock and LISTEN
            with anyio.move_on_after(self._connect_timeout_s, shield=True):
                await session.close()
            session.terminate()
        pool, self._pool = self._pool, None
        if pool is not None:
            with anyio.move_on_after(self._command_timeout_s, shield=True):
                await pool.close()
            pool.terminate()  # a no-op after a clean close; ends connections stuck past the timeout

    async def write_failure(self) -> str | None:
        """Asked of the server: a failover that left the URL on a standby, or a database set read-only,
        answers every read and refuses every write. A server that does not answer raises, as any read."""
        async with self._conn() as conn:
            row = await conn.fetchrow("SELECT pg_is_in_recovery(), current_setting('transaction_read_only')")
        if row[0] or row[1] == "on":
            why = "is a standby in recovery" if row[0] else "runs its transactions read-only"
            return f"store {self._where}: the server {why}, so every write is refused"
        return None

    async def _migrate(self, conn: Conn, migrate: bool) -> int:
        """Bring the schema to SCHEMA_VERSION (when `migrate`); return the version it had."""
        async with conn.transaction():
            if migrate:  # nodes starting together: the first creates, the others wait and find it current
                await conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", f"tidepool.migrate.{self.schema}"
                )
            version = await _schema_version(conn, self.schema)
            if version > SCHEMA_VERSION:
                raise SchemaMismatch(
                    f"store {self._where} has schema version {version}, newer than this tidepool "
                    f"understands ({SCHEMA_VERSION}): upgrade tidepool"
                )
            if version == SCHEMA_VERSION:
                return version
            if not migrate:
                raise SchemaMismatch(
                    f"store {self._where} has schema version {version}, needs {SCHEMA_VERSION}: run `tidepool migrate`"
                )
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            for v in range(version + 1, SCHEMA_VERSION + 1):
                await conn.execute(MIGRATIONS[v].format(s=f'"{self.schema}"'))
                await conn.execute(
                    f'INSERT INTO "{self.schema}".schema_version VALUES ($1, extract(epoch FROM clock_timestamp()))',
                    v,
                )
        return version

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[Conn]:
        """A pooled connection; driver errors leave as StoreUnavailable with the original as cause."""
        if self._pool is None:
            raise StoreUnavailable("the store is not open")
        # A server that accepts and never answers holds every pooled connection: a caller waits for one at
        # most connect_timeout_s, not until a stuck statement gives up (an API call took 60 s).
        try:
            conn = await self._pool.acquire(timeout=self._connect_timeout_s)
        except TimeoutError as exc:
            raise StoreUnavailable(f"store {self._where}: no connection came free within {self._connect_timeout_s:g}s "
                                   f"(all {self._max_connections} are busy, or stuck on a server that does not "
                                   "answer)") from exc
        except DRIVER_ERRORS as exc:
            raise StoreUnavailable(f"store {self._where}: {_said(exc)}") from exc
        try:
            yield conn
        except DRIVER_ERRORS as exc:
            raise StoreUnavailable(f"store {self._where}: {_said(exc)}") from exc
        finally:
            # Giving it back resets it, a round trip: a server that stopped answering fails that too (the
            # pool closes the connection then). It must not replace the caller's answer, nor escape raw:
            # a TimeoutError from here once ended the daemon 40 s into such an outage.
            try:
                await self._pool.release(conn)
            except DRIVER_ERRORS as exc:
                log.debug("store %s: a connection could not be given back: %s", self._where, _said(exc))

    # producers

    async def add(self, new: NewTask, *, now: float, max_queued: int | None = None) -> tuple[Task, bool]:
        async with self._conn() as conn:
            if max_queued is None:
                return await _insert(conn, new, now)
            async with conn.transaction():
                existing = await _existing(conn, new)  # a known task is returned even when the queue is full
                if existing is not None:
                    return existing, False
                await _check_room(conn, 1, max_queued)
                return await _insert(conn, new, now)

    async def add_many(self, batch: Sequence[NewTask], *, now: float,
                       max_queued: int | None = None) -> list[tuple[str, bool]]:
        keyed = {n.idempotency_key: n for n in batch if n.idempotency_key}
        if len(keyed) != sum(1 for n in batch if n.idempotency_key):
            raise Conflict("idempotency_key repeats within the batch")
        async with self._conn() as conn:
            try:
                async with conn.transaction():
                    return await _add_many(conn, batch, keyed, now, max_queued)
            except asyncpg.UniqueViolationError:
                pass  # a submit of one of the keys, in flight beside this one, committed first: now it is seen
            try:
                async with conn.transaction():
                    return await _add_many(conn, batch, keyed, now, max_queued)
            except asyncpg.UniqueViolationError:
                raise Conflict("an idempotency_key of the batch is being used meanwhile; submit it again") from None

    async def get(self, task_id: str) -> Task:
        async with self._conn() as conn:
            row = await conn.fetchrow(GET, task_id)  # one statement: one consistent snapshot
        if row is None:
            raise TaskNotFound(task_id)
        return replace(_task(row, attempts=_attempts(row[19])), results=tuple(_result(r) for r in row[20]))

    async def list_tasks(
        self, *, state: State | None = None, type: str | None = None, limit: int = 50, cursor: str | None = None
    ) -> Page:
        where, args = ["true"], []
        for condition, value in (("state = ", state), ("type = ", type), ("id < ", cursor)):
            if value is not None:
                args.append(str(value))
                where.append(f"{condition}${len(args)}")
        sql = f"SELECT {TASK_COLUMNS}, {ATTEMPTS} FROM tasks t WHERE {' AND '.join(where)} ORDER BY id DESC"
        async with self._conn() as conn:
            rows = await conn.fetch(f"{sql} LIMIT ${len(args) + 1}", *args, limit + 1)
        tasks = [_task(r, attempts=_attempts(r[19])) for r in rows[:limit]]
        return Page(tasks, tasks[-1].id if len(rows) > limit else None)

    async def counts(self) -> dict[State, int]:
        async with self._conn() as conn:
            rows = await conn.fetch(
                "SELECT state, count(*) FROM tasks "
                "WHERE state IN ('pending', 'leased', 'running', 'retry_wait', 'cancelling') GROUP BY state"
            )
        return {State(r[0]): r[1] for r in rows}

    async def request_cancel(self, task_id: str, *, now: float) -> CancelAnswer:
        async with self._conn() as conn, conn.transaction():
            row = await conn.fetchrow("SELECT state, type FROM tasks WHERE id = $1 FOR NO KEY UPDATE", task_id)
            if row is None:
                raise TaskNotFound(task_id)
            current = State(row["state"])
            target = cancel_step(current)
            if target is current:
                return CancelAnswer(target, False, row["type"])
            if target is State.CANCELLED:
                await conn.execute("UPDATE tasks SET state = $1, phase = NULL, error = $4, finished_at = $2, "
                                   "updated_at = $2 WHERE id = $3", target.value, now, task_id,
                                   json.dumps(CANCELLED_ON_REQUEST.to_json()))
            else:
                await conn.execute("UPDATE tasks SET state = $1, cancel_requested_at = $2, updated_at = $2 "
                                   "WHERE id = $3", target.value, now, task_id)
            return CancelAnswer(target, True, row["type"])

    async def retry(self, task_id: str, *, now: float, max_queued: int | None = None) -> Task:
        async with self._conn() as conn, conn.transaction():
            target = retry_step(await _lock_state(conn, task_id))
            if max_queued is not None:
                await _check_room(conn, 1, max_queued)
            # A new budget: attempt counts from zero again; attempts[].number keeps counting every row.
            row = await conn.fetchrow(
                "UPDATE tasks t SET state = $1, attempt = 0, interruptions = 0, available_at = $2, updated_at = $2, "
                f"finished_at = NULL, error = NULL, progress = NULL WHERE id = $3 RETURNING {TASK_COLUMNS}, {ATTEMPTS}",
                target.value,
                now,
                task_id,
            )
            await conn.execute(NOTIFY, "1")
        return _task(row, attempts=_attempts(row[19]))

    # workers

    async def claim(
        self, worker: Worker, where: ClaimFilter, *, limit: int, now: float, lease_s: float
    ) -> list[Claimed]:
        if limit <= 0:
            return []
        group = self._claims.get(where)
        if group is None:
            if len(self._claims) >= MAX_CLAIM_GROUPS:
                self._claims = {k: g for k, g in self._claims.items() if g.busy}
            group = self._claims[where] = _Group(lambda calls: self._claim_group(where, calls))
        return await group(_ClaimCall(worker, limit, now, lease_s))

    async def _claim_group(self, where: ClaimFilter, calls: list[_ClaimCall]) -> list[list[Claimed]]:
        """Leases for every queued claim of one filter in one statement, split in queue order."""
        slots = [(call, new_id(call.now), new_token()) for call in calls for _ in range(call.limit)]
        patterns = None if "*" in where.type_globs else [_glob_regex(g) for g in where.type_globs]
        tag_sets = json.dumps([sorted(s) for s in where.tag_sets]) if where.tag_sets else None
        async with self._conn() as conn:
            rows = await conn.fetch(
                CLAIM,
                min(c.now for c in calls),
                len(slots),
                [s[1] for s in slots],
                [s[2] for s in slots],
                [s[0].worker.node_id for s in slots],
                [s[0].worker.instance_id for s in slots],
                [s[0].worker.worker_id for s in slots],
                [s[0].now for s in slots],
                [s[0].now + s[0].lease_s for s in slots],
                patterns,
                tag_sets,
            )
        claimed: dict[int, list[Claimed]] = {id(c): [] for c in calls}
        for row in rows:  # ordered by slot: each claim gets its run of the queue's head
            call, attempt_id, token = slots[row[0] - 1]
            task = _task(row[1:])
            claimed[id(call)].append(Claimed(task, Lease(task.id, attempt_id, token, call.now + call.lease_s)))
        return [claimed[id(c)] for c in calls]

    async def renew(self, leases: Sequence[Lease], *, now: float, lease_s: float) -> dict[str, LeaseLost]:
        if not leases:
            return {}
        async with self._conn() as conn:
            renewed = await conn.fetch(RENEW, *_lease_arrays(leases), now, now + lease_s)
            return await _lost(conn, leases, {r[0] for r in renewed})

    async def set_phase(self, notes: Sequence[PhaseNote], *, now: float) -> dict[str, LeaseLost]:
        if not notes:
            return {}
        latest = list({n.lease.attempt_id: n for n in notes}.values())  # one row per lease: the last note
        leases = [n.lease for n in latest]
        phases = [n.phase.value for n in latest]
        progress = [progress_text(n.progress) for n in latest]
        async with self._conn() as conn:
            noted = await conn.fetch(SET_PHASE, *_lease_arrays(leases), phases, progress, now)
            return await _lost(conn, leases, {r[0] for r in noted})

    async def record_result(self, lease: Lease, batch: ResultBatch, *, now: float) -> ResultBatch:
        # Retried by key: a write whose answer was lost comes back as the stored batch.
        return await _retried(lambda: self._record_result(lease, batch, now))

    async def _record_result(self, lease: Lease, batch: ResultBatch, now: float) -> ResultBatch:
        async with self._conn() as conn:
            fenced, stored = await conn.fetchrow(
                RECORD_RESULT,
                lease.task_id,
                lease.attempt_id,
                lease.token,
                now,
                batch.idempotency_key,
                batch.plugin,
                batch.sequence,
                batch.sha256,
                batch.final,
                json.dumps(batch.payload),
            )
            if not fenced:
                raise await _why_lost(conn, lease)
            if stored:
                return replace(batch, attempt_id=lease.attempt_id)
            earlier = await conn.fetchrow(EARLIER_RESULT, batch.idempotency_key)
        if earlier is None:  # its task was pruned between the two statements
            raise StoreUnavailable(f"result key {batch.idempotency_key} changed hands during the write; retry")
        if earlier[3] != batch.sha256:
            raise Conflict(f"result key {batch.idempotency_key} was stored with another sha256")
        return _result(earlier)

    async def finish(self, lease: Lease, outcome: Outcome, *, now: float, policy: RetryPolicy) -> State:
        result = (await self.finish_many([Ending(lease, outcome, now)], policy=policy))[0]
        if isinstance(result, TidepoolError):
            raise result
        return result

    async def finish_many(self, endings: Sequence[Ending], *, policy: RetryPolicy) -> list[State | TidepoolError]:
        """Bare successes of distinct tasks in one statement (the common case, no task started); every
        other ending on its own path, each task's endings in order so a later one meets the fence an earlier
        one left, all tasks at once."""
        if len(endings) == 1:  # finish(): nothing to share
            return [await self._finish_one(endings[0], policy, maybe_written=endings[0].resent)]
        answers: list[State | TidepoolError | None] = [None] * len(endings)
        maybe_written = {i for i, ending in enumerate(endings) if ending.resent}
        fast = [i for i, ok in enumerate(completable_at_once(endings)) if ok]
        if fast:
            try:
                done = await self._complete_group([(endings[i].lease, endings[i].now, endings[i].outcome.progress)
                                                   for i in fast])
            except StoreUnavailable:  # perhaps written with the answer lost: their own paths find out
                done = [False] * len(fast)
                maybe_written.update(fast)
            for i, completed in zip(fast, done, strict=True):
                if completed:
                    answers[i] = State.COMPLETED
        by_task: dict[str, list[int]] = {}
        for i, answer in enumerate(answers):
            if answer is None:
                by_task.setdefault(endings[i].lease.task_id, []).append(i)

        async def end(indexes: list[int]) -> None:
            for i in indexes:
                answers[i] = await self._finish_one(endings[i], policy, maybe_written=i in maybe_written)

        if by_task:
            async with anyio.create_task_group() as tg:
                for indexes in by_task.values():
                    tg.start_soon(end, indexes)
        return cast("list[State | TidepoolError]", answers)  # every slot answered above

    async def _finish_one(self, ending: Ending, policy: RetryPolicy, *,
                          maybe_written: bool = False) -> State | TidepoolError:
        """One ending, tried again while the server is away; its error returned, not raised. `maybe_written`:
        an earlier write of it may have committed unanswered, so meeting its own fence is not yet a refusal."""
        lease = ending.lease
        try:
            return await _retried(lambda: self._finish(ending, policy),
                                  ended=lambda: self._ended(lease, ending.now), retried=maybe_written)
        except TidepoolError as exc:
            return exc
        except Exception as exc:
            log.error("task %s attempt %s: finish failed: %r", lease.task_id, lease.attempt_id, exc)
            error = StoreUnavailable(f"task {lease.task_id} attempt {lease.attempt_id}: finish failed: {_said(exc)}")
            error.__cause__ = exc
            return error

    async def _ended(self, lease: Lease, now: float) -> State | None:
        """After a retried finish met its own fence: the task's state if this very write had in fact ended
        the attempt. Its end time tells it from an end someone else wrote meanwhile (the reconciler's
        cancel deadline, say), which this worker must not report a second time."""
        async with self._conn() as conn:
            row = await conn.fetchrow(
                "SELECT t.state, a.status FROM attempts a JOIN tasks t ON t.id = a.task_id "
                "WHERE a.id = $1 AND a.finished_at = $2",
                lease.attempt_id,
                now,
            )
        ended = row is not None and row[1] not in ("leased", "running", "expired")
        return State(row[0]) if ended else None

    async def _finish(self, ending: Ending, policy: RetryPolicy) -> State:
        lease, outcome, now = ending.lease, ending.outcome, ending.now
        if completable_at_once([ending])[0] and await self._completions((lease, now, outcome.progress)):
            return State.COMPLETED
        async with self._conn() as conn, conn.transaction():
            row = await conn.fetchrow(ENDING_ROW, lease.task_id, lease.attempt_id, lease.token)
            if row is None or not _may_end(State(row[0]), row[4], now):
                raise await _why_lost(conn, lease)
            end = decide_end(
                State(row[0]),
                outcome,
                attempt=row[1],
                max_attempts=row[2],
                interruptions=row[3],
                policy=policy,
                now=now,
            )
            await _write_ends(conn, [(lease, outcome, end)], now)
            if end.state in (State.PENDING, State.RETRY_WAIT) and (end.available_at or now) <= now:
                await conn.execute(NOTIFY, "1")  # back in the queue at once (interrupted): others may take it
        return end.state

    async def _complete_group(self, calls: list[tuple[Lease, float, dict[str, Any] | None]]) -> list[bool]:
        """Bare successes of many workers, fenced and completed in one statement; False: the slow path."""
        leases = [lease for lease, _, _ in calls]
        async with self._conn() as conn:
            done = await conn.fetch(COMPLETE, *_lease_arrays(leases), [now for _, now, _ in calls],
                                    [progress_text(p) for _, _, p in calls])
        completed = {r[0] for r in done}
        return [lease.attempt_id in completed for lease in leases]

    # schedules

    async def save_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        async with self._conn() as conn, conn.transaction():
            existing = await _locked_schedule(conn, schedule.name)
            saved = schedules.merge(existing, schedule, now)
            await conn.execute(SAVE_SCHEDULE, *_schedule_args(saved))
        return saved

    async def list_schedules(self) -> list[Schedule]:
        async with self._conn() as conn:
            rows = await conn.fetch(f"SELECT {SCHEDULE_COLUMNS} FROM schedules ORDER BY name")
        return [_schedule(r) for r in rows]

    async def delete_schedule(self, name: str, *, config_node: str | None = None) -> None:
        async with self._conn() as conn:
            deleted = await conn.fetchval("DELETE FROM schedules WHERE name = $1 AND ($2::text IS NULL OR "
                                          "spec::jsonb ->> 'config_node' = $2) RETURNING 1", name, config_node)
            if deleted is None:
                raise ScheduleNotFound(name)

    async def pause_schedule(self, name: str, *, paused: bool, now: float) -> Schedule:
        async with self._conn() as conn, conn.transaction():
            existing = await _locked_schedule(conn, name)
            if existing is None:
                raise ScheduleNotFound(name)
            saved = schedules.set_paused(existing, paused, now)
            await conn.execute(SAVE_SCHEDULE, *_schedule_args(saved))
        return saved

    async def fire_schedules(self, *, now: float, new_task: Callable[[Schedule, float], NewTask] | None = None,
                             defines: Callable[[str], bool] = lambda type_name: True,
                             max_queued: int | None = None) -> list[Fired]:
        async with self._conn() as conn:
            due = await conn.fetch("SELECT name, spec FROM schedules WHERE NOT paused AND next_run_at <= $1", now)
            fired: list[Fired] = []
            for name, spec in due:
                if not defines(schedules.stored_spec(spec)["type"]):
                    continue  # a node that defines the type fires it
                async with conn.transaction():
                    these = await _fire(conn, name, now, new_task, max_queued)
                    if created := sum(1 for f in these if f.task_id is not None):
                        await conn.execute(NOTIFY, str(created))
                fired.extend(these)
        return fired

    # the reconciler: each pass takes only rows no other node holds (SKIP LOCKED), in bounded steps

    async def expire_leases(
        self, *, now: float, policy: RetryPolicy, node_id: str | None = None, keep_instance: str | None = None,
        interrupted: frozenset[str] = frozenset(),
    ) -> list[Expired]:
        args: list[Any]
        if node_id is None:
            sql, args = EXPIRING.format(where="lease_expires_at <= $1"), [now]
        else:
            where = "node_id = $1 AND lease_instance IS DISTINCT FROM $2"
            sql, args = EXPIRING.format(where=where), [node_id, keep_instance]
        expired: list[Expired] = []
        while True:
            async with self._conn() as conn, conn.transaction():
                rows = await conn.fetch(sql, *args)
                ends = [(Lease(r[4], r[5], r[6], now), o, _expiry(r, o, policy, now))
                        for r in rows for o in (expiry_outcome(r[5], interrupted),)]
                if ends:
                    await _write_ends(conn, ends, now)
            expired.extend(Expired(lease.task_id, lease.attempt_id, end.state, r[7])
                           for (lease, _, end), r in zip(ends, rows, strict=True))
            if len(rows) < SWEEP:
                return expired

    async def promote_due(self, *, now: float) -> int:
        async with self._conn() as conn:
            promoted = await conn.fetchval(PROMOTE, now, step(State.RETRY_WAIT, Event.PROMOTE).value)
        return int(promoted)

    async def finish_cancels(self, *, now: float, deadline_s: float) -> list[Ended]:
        error = cancel_deadline_error(deadline_s)
        args = (now - deadline_s, now, json.dumps(error.to_json()), step(State.CANCELLING, Event.CANCEL_ACK).value)
        return await self._sweep(FINISH_CANCELS, *args)

    async def prune(self, *, before: float) -> int:
        pruned = 0
        while True:
            async with self._conn() as conn:
                n = int(await conn.fetchval(PRUNE, before))
            pruned += n
            if n < SWEEP:
                break
        async with self._conn() as conn:  # nodes not heard from since `before` are gone for good
            await conn.execute(PRUNE_NODES, before)
        return pruned

    async def queued_tag_sets(self) -> list[frozenset[str]]:
        async with self._conn() as conn:
            rows = await conn.fetch(QUEUED_TAG_SETS)
        return [frozenset(r[0]) for r in rows]

    async def fail_unserviceable(self, tags: frozenset[str], *, now: float, message: str) -> list[Ended]:
        error = TaskError("unserviceable", message, retryable=False)
        args = (sorted(tags), step(State.PENDING, Event.UNSERVICEABLE).value, json.dumps(error.to_json()), now)
        return await self._sweep(FAIL_UNSERVICEABLE, *args)

    async def _sweep(self, sql: str, *args: Any) -> list[Ended]:
        """Run a statement that ends up to SWEEP tasks and returns their ids and types, until it ends fewer:
        one short transaction each, never one long one holding every row's lock."""
        ended: list[Ended] = []
        while True:
            async with self._conn() as conn:
                rows = await conn.fetch(sql, *args)
            ended.extend(Ended(r[0], r[1]) for r in rows)
            if len(rows) < SWEEP:
                return ended

    # the fleet

    async def lock_node(self, node_id: str, instance_id: str) -> None:
        """A session advisory lock on (schema, node_id), held on the dedicated connection until close()."""
        conn = await self._connect_session()
        try:
            if not await conn.fetchval(NODE_LOCK, self._node_key(node_id)):
                holder = await conn.fetchrow(f"SELECT {NODE_COLUMNS} FROM nodes WHERE node_id = $1", node_id)
                raise ConfigError(_node_taken(node_id, self._where, None if holder is None else _node(holder)))
        except DRIVER_ERRORS as exc:
            conn.terminate()
            raise StoreUnavailable(
                f"store {self._where}: cannot take the lock of node {node_id}: {_said(exc)}") from exc
        except BaseException:
            conn.terminate()
            raise
        self._node, self._node_locked = (node_id, instance_id), True
        await self._replace_session(conn)

    async def save_node(self, node: Node) -> None:
        args = (node.node_id, node.instance_id, node.hostname, node.pid, node.version, node.started_at,
                node.heartbeat_at, node.heartbeat_s, node.stopped_at, list(node.task_types),
                json.dumps([list(t) for t in node.tags]), node.max_workers)  # fmt: skip
        async with self._conn() as conn:
            await conn.execute(SAVE_NODE, *args)

    async def list_nodes(self) -> list[Node]:
        async with self._conn() as conn:
            rows = await conn.fetch(f"SELECT {NODE_COLUMNS} FROM nodes ORDER BY node_id")
        return [_node(r) for r in rows]

    async def watch(
        self, wake: Callable[[int], None], *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """LISTEN on the dedicated connection until cancelled; re-established with backoff after a drop.

        Reports started at once: the first connection may fail like any later one, and the pool's poll
        covers the gap. After a reconnect every sleeping worker is woken, for what was missed meanwhile.
        """

        def heard(conn: Conn, pid: int, channel: str, payload: str) -> None:
            try:
                n = int(payload)
            except ValueError:
                n = 1
            wake(max(1, min(n, MAX_WAKE)))

        task_status.started()
        backoff, dropped = 0.1, False
        while True:
            lost = anyio.Event()
            conn: Conn = self._session
            try:
                if conn is None or conn.is_closed():
                    conn = None
                    conn = await self._connect_session()
                    self._node_locked = False  # the server ended the old session, and the lock with it
                    await self._replace_session(conn)
                    await self._retake_node_lock(conn)
                conn.add_termination_listener(lambda _conn, lost=lost: lost.set())
                await conn.add_listener(self.channel, heard)
            except SESSION_ERRORS as exc:
                (log.debug if dropped else log.warning)(
                    "store %s: cannot LISTEN (%s); retrying with backoff", self._where, exc
                )
                self._drop_session(conn)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX_S)
                dropped = True
                continue
            if dropped:
                log.info("store %s: LISTEN connection re-established", self._where)
                wake(MAX_WAKE)
            backoff, dropped = 0.1, False
            await self._keep(conn, lost)
            log.warning("store %s: LISTEN connection lost; reconnecting", self._where)
            dropped = True
            self._drop_session(conn)

    def _drop_session(self, conn: Conn) -> None:
        """Close `conn` (None: nothing to close); if it was the session, the node lock went with it."""
        if conn is None:
            return
        conn.terminate()
        if self._session is conn:
            self._session, self._node_locked = None, False

    async def _keep(self, conn: Conn, lost: anyio.Event) -> None:
        """Until the connection ends: it is asked to answer every PING_EVERY_S, so a dead peer shows."""
        while not lost.is_set():
            with anyio.move_on_after(PING_EVERY_S):
                await lost.wait()
                return
            try:
                with anyio.fail_after(PING_EVERY_S):
                    await conn.execute("SELECT 1")
                    await self._retake_node_lock(conn)  # not yet taken back after a reconnect: try again
            except DRIVER_ERRORS:
                return

    async def _connect_session(self) -> Conn:
        try:
            return await asyncpg.connect(
                self.url, timeout=self._connect_timeout_s, command_timeout=self._command_timeout_s,
                server_settings={**self._settings, "application_name": f"tidepool {self.schema} session"},
            )  # fmt: skip
        except DRIVER_ERRORS as exc:
            raise StoreUnavailable(f"store {self._where}: cannot connect: {_said(exc)}") from exc

    async def _replace_session(self, conn: Conn) -> None:
        old, self._session = self._session, conn
        if old is not None and old is not conn:
            old.terminate()

    async def _retake_node_lock(self, conn: Conn) -> None:
        """After a reconnect the lock went with the old session: take it again, now or at a later ping.

        Until the server notices the old connection is dead, the old session may still hold it.
        """
        if self._node is None or self._node_locked:
            return
        node_id, instance_id = self._node
        if await conn.fetchval(NODE_LOCK, self._node_key(node_id)):
            self._node_locked = True
            if self._lock_missing_said:
                log.info("node %s holds its lock on store %s again", node_id, self._where)
            self._lock_missing_said = False
            return
        if not self._lock_missing_said:
            holder = await conn.fetchrow(f"SELECT {NODE_COLUMNS} FROM nodes WHERE node_id = $1", node_id)
            other = None if holder is None else _node(holder)
            if other is not None and other.instance_id == instance_id:
                log.warning("node %s: its lock is still held by this process' dropped session; will retry", node_id)
            else:
                log.error("%s; this process carries on and retries", _node_taken(node_id, self._where, other))
            self._lock_missing_said = True

    def _node_key(self, node_id: str) -> str:
        return f"tidepool.node.{self.schema}.{node_id}"


# grouping many callers' writes into one statement


@dataclass(frozen=True, slots=True, eq=False)
class _ClaimCall:
    worker: Worker
    limit: int
    now: float
    lease_s: float


class _Group(Generic[I, R]):
    """Group commit: calls that queue up while one statement is in flight go out together in the next.

    A short-lived flusher task, owned here and awaited by drain(), sends the statements, so a caller
    cancelled mid-write cannot abort the write of the others (asyncio's own cancellation passes
    through anyio's shield). Each caller gets its own result; a failed statement gives each its own
    StoreUnavailable.
    """

    def __init__(self, run: Callable[[list[I]], Awaitable[list[R]]]) -> None:
        self._run = run
        self._queue: deque[tuple[I, asyncio.Future[R]]] = deque()
        self._flusher: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        return self._flusher is not None

    async def __call__(self, item: I) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._queue.append((item, future))
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush(), name="tidepool-postgres-group")
        return await future

    async def drain(self) -> None:
        """Wait until the calls already queued have been written."""
        if self._flusher is not None:
            await asyncio.wait([self._flusher])

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch: list[tuple[I, asyncio.Future[R]]] = []
                while self._queue and len(batch) < MAX_GROUP:
                    item, future = self._queue.popleft()
                    if not future.done():  # a caller cancelled while it waited is not written
                        batch.append((item, future))
                if batch:
                    await self._send(batch)
        finally:
            self._flusher = None
            while self._queue:  # left only when the flusher itself was cancelled (loop shutdown)
                _, future = self._queue.popleft()
                if not future.done():
                    future.set_exception(StoreUnavailable("the store shut down before this write was sent"))

    async def _send(self, batch: list[tuple[I, asyncio.Future[R]]]) -> None:
        try:
            results = await self._run([item for item, _ in batch])
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    error = StoreUnavailable(f"grouped write failed: {_said(exc)}")
                    error.__cause__ = exc.__cause__ if isinstance(exc, StoreUnavailable) else exc
                    future.set_exception(error)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


async def _retried(write: Callable[[], Awaitable[R]], *, ended: Callable[[], Awaitable[R | None]] | None = None,
                   retried: bool = False) -> R:
    """A fenced worker write, tried again while the server does not answer, for up to WRITE_RETRY_S.

    Safe because of the fence: the retry carries the same lease and the same `now` (when the outcome was
    reached), so it lands only if no one has expired or taken over the lease meanwhile. A blip (a server
    restart, a dropped connection) then costs a moment instead of a re-run of the whole task. When the
    first try did commit but its answer was lost, the retry meets its own fence: `ended` tells. `retried`:
    the caller already sent this write once without an answer.
    """
    deadline = time.monotonic() + WRITE_RETRY_S
    delay = 0.05
    while True:
        try:
            return await write()
        except LeaseLost:
            if retried and ended is not None and (done := await ended()) is not None:
                return done
            raise
        except StoreUnavailable:
            if time.monotonic() + delay > deadline:
                raise
        await anyio.sleep(delay)
        delay, retried = min(delay * 2, 1.0), True


def channel_for(schema: str) -> str:
    """The NOTIFY channel of a schema: a name of at most 63 bytes, as PostgreSQL requires."""
    channel = f"tidepool.{schema}"
    return channel if len(channel.encode()) <= 63 else f"tidepool.{hashlib.md5(schema.encode()).hexdigest()}"


def _split_schema(url: str) -> tuple[str, str | None]:
    """The URL without its `schema` query parameter (asyncpg would send it to the server), and that schema."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schemas = [v for k, v in query if k == "schema"]
    if not schemas:
        return url, None
    rest = urlencode([(k, v) for k, v in query if k != "schema"])
    return urlunsplit(parts._replace(query=rest)), schemas[-1]


def _node(row: Any) -> Node:
    tags = tuple(tuple(t) for t in json.loads(row[10]))
    return Node(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], tuple(row[9]), tags, row[11],
                stopped_at=row[8])  # fmt: skip


def _said(exc: BaseException) -> str:
    """What went wrong, in words: a timeout's own text is empty ("TimeoutError: " told a user nothing)."""
    if isinstance(exc, StoreUnavailable):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return f"no answer in time{f' ({exc})' if str(exc) else ''}: the server or the network is stuck"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _node_taken(node_id: str, where: str, holder: Node | None) -> str:
    if holder is None:
        who = "another process"
    else:
        seen = time.time() - holder.heartbeat_at
        who = (f"pid {holder.pid} on {holder.hostname} (instance {holder.instance_id}, "
               f"tidepool {holder.version}, heard from {seen:.0f}s ago)")  # fmt: skip
    return (
        f"node {node_id} already runs on store {where}: {who} holds its lock; "
        "stop it or give this daemon another node.id"
    )


# SQL helpers, each run on a connection the caller holds


async def _schema_version(conn: Conn, schema: str) -> int:
    if await conn.fetchval("SELECT to_regclass($1)", f'"{schema}".schema_version') is None:
        return 0
    return int(await conn.fetchval(f'SELECT coalesce(max(version), 0) FROM "{schema}".schema_version'))


async def _add_many(conn: Conn, batch: Sequence[NewTask], keyed: dict[str, NewTask], now: float,
                    max_queued: int | None) -> list[tuple[str, bool]]:
    """add_many's transaction: the keyed tasks that exist already are those tasks (same body), the rest go in."""
    existing: dict[str | None, str] = {}
    if keyed:
        for r in await conn.fetch("SELECT idempotency_key, id, fingerprint FROM tasks "
                                  "WHERE idempotency_key = ANY($1::text[])", list(keyed)):
            if r["fingerprint"] != keyed[r["idempotency_key"]].fingerprint():
                raise Conflict(f"idempotency_key {r['idempotency_key']!r} was used with another body")
            existing[r["idempotency_key"]] = r["id"]
    rows = [_insert_args(n, now) for n in batch if n.idempotency_key not in existing]
    if rows:
        if max_queued is not None:
            await _check_room(conn, len(rows), max_queued)
        await conn.executemany(INSERT_MANY, rows)
        await conn.execute(NOTIFY, str(len(rows)))
    return batch_answer(batch, existing, (r[0] for r in rows))


async def _lock_state(conn: Conn, task_id: str) -> State:
    current = await conn.fetchval("SELECT state FROM tasks WHERE id = $1 FOR NO KEY UPDATE", task_id)
    if current is None:
        raise TaskNotFound(task_id)
    return State(current)


async def _existing(conn: Conn, new: NewTask) -> Task | None:
    if not new.idempotency_key:
        return None
    sql = f"SELECT {TASK_COLUMNS}, fingerprint FROM tasks WHERE idempotency_key = $1"
    row = await conn.fetchrow(sql, new.idempotency_key)
    if row is None:
        return None
    if row[-1] != new.fingerprint():
        raise Conflict(f"idempotency_key {new.idempotency_key!r} was used with another body")
    return _task(row)


async def _check_room(conn: Conn, n: int, max_queued: int) -> None:
    check_room(await _queued(conn, max_queued), n, max_queued)


async def _queued(conn: Conn, max_queued: int) -> int:
    """The tasks queued (counted up to max_queued + 1), holding the count until the transaction ends:
    submits that check the limit take turns, so two nodes cannot both fill the last places."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('tidepool.queued.' || current_schema(), 0))")
    queued: int = await conn.fetchval(QUEUED, max_queued + 1)
    return queued


def _insert_args(new: NewTask, now: float, task_id: str | None = None) -> tuple[Any, ...]:
    available_at = new.available_at if new.available_at is not None else now
    return (task_id or new_id(now), new.type, json.dumps(new.payload), new.priority, new.max_attempts, new.timeout_s,
            sorted(new.required_tags), new.idempotency_key, new.fingerprint(), now, available_at)  # fmt: skip


async def _insert(conn: Conn, new: NewTask, now: float) -> tuple[Task, bool]:
    """Insert, or find the task that holds this idempotency key (maybe committed by another node just now)."""
    row = await conn.fetchrow(INSERT, *_insert_args(new, now))
    if row is not None:
        return _task(row), True
    existing = await _existing(conn, new)
    if existing is None:  # that task was pruned in between: rare enough to report, not to loop on
        raise StoreUnavailable(f"idempotency_key {new.idempotency_key!r} changed hands during the submit; retry")
    return existing, False


async def _locked_schedule(conn: Conn, name: str) -> Schedule | None:
    row = await conn.fetchrow(f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE name = $1 FOR UPDATE", name)
    return None if row is None else _schedule(row)


async def _fire(conn: Conn, name: str, now: float, new_task: Callable[[Schedule, float], NewTask] | None,
                max_queued: int | None) -> list[Fired]:
    """Fire one due schedule, holding its row; nothing when another node holds or has just fired it."""
    row = await conn.fetchrow(DUE_SCHEDULE, name, now)
    if row is None:
        return []
    schedule = _schedule(row)
    # schedules.fire() asks its questions synchronously: answer them from what the store holds now.
    firing = schedules.plan(schedule, now)
    ticks = firing.fire
    keys = [schedules.tick_key(schedule, t) for t in ticks]
    used = await conn.fetch("SELECT idempotency_key FROM tasks WHERE idempotency_key = ANY($1::text[])", keys)
    taken = {r[0] for r in used}
    last_active = schedule.last_task_id is not None and await conn.fetchval(
        f"SELECT {TERMINAL_SQL} IS FALSE FROM tasks WHERE id = $1", schedule.last_task_id
    )
    created: dict[str, NewTask] = {}
    room = None if max_queued is None or not ticks else max_queued - await _queued(conn, max_queued)

    def add(new: NewTask) -> str | None:
        nonlocal room
        if new.idempotency_key in taken:
            return None
        if room is not None:
            if room <= 0:
                raise QueueFull(f"pool.max_queued is {max_queued}")
            room -= 1
        task_id = new_id(now)
        created[task_id] = new
        return task_id

    def running(task_id: str) -> bool:
        return task_id in created or (task_id == schedule.last_task_id and bool(last_active))

    fired, saved = schedules.fire(schedule, now, new_task=new_task, running=running, add=add, firing=firing)
    for task_id, new in created.items():
        if await conn.fetchrow(INSERT, *_insert_args(new, now, task_id)) is None:
            # Only a submit that borrowed this tick's key can get here: give up this pass, retry the next.
            raise StoreUnavailable(f"schedule {name!r}: key {new.idempotency_key!r} was taken meanwhile; will retry")
    await conn.execute(SAVE_SCHEDULE, *_schedule_args(saved))
    return fired


def _schedule(row: Any) -> Schedule:
    return Schedule(row[0], **schedules.stored_spec(row[1]), paused=row[2], next_tick_at=row[3], next_run_at=row[4],
                    last_run_at=row[5], last_task_id=row[6])


def _schedule_args(s: Schedule) -> tuple[Any, ...]:
    spec = json.dumps(schedules.spec_of(s))
    return (s.name, spec, s.paused, s.next_tick_at, s.next_run_at, s.last_run_at, s.last_task_id)


def _glob_regex(glob: str) -> str:
    """An anchored PostgreSQL regex that matches what fnmatch.fnmatchcase(name, glob) matches."""
    out, i, n = ["^"], 0, len(glob)
    while i < n:
        c, i = glob[i], i + 1
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[" and (j := _class_end(glob, i)) is not None:
            out.append(_char_class(glob[i:j]))
            i = j + 1
        else:
            out.append(_literal(c))
    return "".join(out) + "$"


def _class_end(glob: str, i: int) -> int | None:
    """Where the class opened just before i closes, as fnmatch reads it; None: the `[` is literal."""
    j = i + 1 if i < len(glob) and glob[i] == "!" else i
    j = j + 1 if j < len(glob) and glob[j] == "]" else j
    j = glob.find("]", j)
    return None if j < 0 else j


def _char_class(body: str) -> str:
    negate = body.startswith("!")
    body = body[1:] if negate else body
    items, k = [], 0
    while k < len(body):
        if k + 2 < len(body) and body[k + 1] == "-":
            if body[k] <= body[k + 2]:  # fnmatch drops reversed ranges
                items.append(f"{_literal(body[k])}-{_literal(body[k + 2])}")
            k += 3
        else:
            items.append(_literal(body[k]))
            k += 1
    if not items:  # fnmatch: an empty class matches nothing, a negated one any character
        return "." if negate else "[^\\x00-\\U0010FFFF]"
    return f"[{'^' if negate else ''}{''.join(items)}]"


def _literal(c: str) -> str:
    # In PostgreSQL's regexes a backslash makes any non-alphanumeric character literal.
    return c if c.isalnum() or not c.isascii() else "\\" + c


def _lease_arrays(leases: Sequence[Lease]) -> tuple[list[str], list[str], list[str]]:
    return [x.task_id for x in leases], [x.attempt_id for x in leases], [x.token for x in leases]


async def _lost(conn: Conn, leases: Sequence[Lease], kept: set[str]) -> dict[str, LeaseLost]:
    """The leases a multi-row write did not take, each with why (read afresh: a cancel may have won)."""
    missed = [lease for lease in leases if lease.attempt_id not in kept]
    if not missed:
        return {}
    cancelling = {r[0] for r in await conn.fetch(CANCELLING, *_lease_arrays(missed))}
    return {
        x.attempt_id: TaskCancelling(x.task_id, x.attempt_id)
        if x.attempt_id in cancelling
        else LeaseLost(x.task_id, x.attempt_id)
        for x in missed
    }


async def _why_lost(conn: Conn, lease: Lease) -> LeaseLost:
    if await conn.fetchval(WHY_LOST, lease.task_id, lease.attempt_id, lease.token) == State.CANCELLING:
        return TaskCancelling(lease.task_id, lease.attempt_id)
    return LeaseLost(lease.task_id, lease.attempt_id)


def _may_end(state: State, lease_expires_at: float, now: float) -> bool:
    """A worker may end its attempt while its lease is live, and always acknowledge a cancel."""
    return state is State.CANCELLING or (state.active and lease_expires_at > now)


def _expiry(row: Any, outcome: Outcome, policy: RetryPolicy, now: float) -> Decision:
    return decide_end(
        State(row[0]), outcome, attempt=row[1], max_attempts=row[2], interruptions=row[3], policy=policy, now=now
    )


async def _write_ends(conn: Conn, ends: list[tuple[Lease, Outcome, Decision]], now: float) -> None:
    """Write how attempts ended, all in one statement; the caller holds their task rows locked."""
    await conn.execute(
        WRITE_ENDS,
        [lease.task_id for lease, _, _ in ends],
        [lease.attempt_id for lease, _, _ in ends],
        [e.state.value for _, _, e in ends],
        [e.attempt_status.value for _, _, e in ends],
        [None if e.error is None else json.dumps(e.error.to_json()) for _, _, e in ends],
        [1 if e.uncount_attempt else 0 for _, _, e in ends],
        [e.available_at for _, _, e in ends],
        [None if e.available_at is not None else now for _, _, e in ends],  # queued again: not finished
        [o.exit_status for _, o, _ in ends],
        [o.stderr_tail for _, o, _ in ends],
        [progress_text(o.progress) for _, o, _ in ends],
        now,
    )


# rows to domain objects


def _task(row: Any, *, attempts: tuple[Attempt, ...] = ()) -> Task:
    """A Task from a row that starts with TASK_COLUMNS."""
    return Task(
        id=row[0],
        type=row[1],
        payload=_loads(row[2]),
        priority=row[3],
        state=State(row[4]),
        phase=None if row[5] is None else Phase(row[5]),
        progress=None if row[6] is None else json.loads(row[6]),
        attempt=row[7],
        max_attempts=row[8],
        interruptions=row[9],
        timeout_s=row[10],
        required_tags=tuple(row[11]),
        idempotency_key=row[12],
        node_id=row[13],
        error=None if row[14] is None else _error(row[14]),
        created_at=row[15],
        updated_at=row[16],
        available_at=row[17],
        finished_at=row[18],
        attempts=attempts,
    )


def _loads(text: str) -> Any:
    # Most payloads of a busy queue are empty; skip the parser for them.
    return {} if text == "{}" else json.loads(text)


def _error(text: str) -> TaskError:
    data = json.loads(text)
    return TaskError(data["code"], data["message"])


def _attempts(rows: Sequence[Any]) -> tuple[Attempt, ...]:
    return tuple(_attempt(r) for r in rows)


def _attempt(r: Any) -> Attempt:
    error = None if r[8] is None else _error(r[8])
    return Attempt(r[0], r[1], r[2], r[3], r[4], AttemptStatus(r[5]), r[6], r[7], error, r[9], r[10])


def _result(row: Any) -> ResultBatch:
    return ResultBatch(row[0], row[1], row[2], row[3], bool(row[4]), json.loads(row[5]), row[6])
