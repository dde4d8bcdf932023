-- The upkeep's statements: the reconciler's passes, and the fleet's.
--
-- The reconciler's passes take only rows no other node holds (SKIP LOCKED); those that end tasks take
-- at most as many rows per transaction as their last parameter says: bounded locks and WAL per step.
-- The fleet's are the server's own state, the node lock (held by each node's dedicated session) and the
-- nodes' rows.

-- name: expiring
SELECT state, attempt, max_attempts, interruptions, id, lease_attempt_id, lease_token, type, scan_id, scan_index,
       lease_expires_at, (SELECT a.deadline_at FROM attempts a WHERE a.id = tasks.lease_attempt_id)
FROM tasks WHERE state IN {active} AND lease_expires_at <= $1
LIMIT $2 FOR NO KEY UPDATE SKIP LOCKED

-- name: expiring_of_node
-- Every lease of a node's other processes (a restart of that node), expired or not.
SELECT state, attempt, max_attempts, interruptions, id, lease_attempt_id, lease_token, type, scan_id, scan_index,
       lease_expires_at, (SELECT a.deadline_at FROM attempts a WHERE a.id = tasks.lease_attempt_id)
FROM tasks WHERE state IN {active} AND node_id = $1 AND lease_instance IS DISTINCT FROM $2
LIMIT $3 FOR NO KEY UPDATE SKIP LOCKED

-- name: promote
WITH due AS (
    SELECT id FROM tasks WHERE state = 'retry_wait' AND available_at <= $1 FOR NO KEY UPDATE SKIP LOCKED
), promoted AS (
    UPDATE tasks t SET state = $2, updated_at = $1 FROM due WHERE t.id = due.id RETURNING t.id
)
SELECT count(*), CASE WHEN count(*) > 0 THEN pg_notify(current_setting('tidepool.channel'), count(*)::text) END
FROM promoted

-- name: finish_cancels
WITH due AS (
    SELECT id, lease_attempt_id FROM tasks WHERE state = 'cancelling' AND cancel_requested_at <= $1
    LIMIT $5 FOR NO KEY UPDATE SKIP LOCKED
), ended AS (
    UPDATE attempts a SET status = 'cancelled', finished_at = $2, error = $3
    FROM due WHERE a.id = due.lease_attempt_id
)
UPDATE tasks t SET state = $4, phase = NULL, error = $3, finished_at = $2, updated_at = $2, lease_token = NULL
FROM due WHERE t.id = due.id RETURNING t.id, t.type

-- name: queued_tag_sets
SELECT DISTINCT required_tags FROM tasks WHERE state IN {queued} AND cardinality(required_tags) > 0

-- name: fail_unserviceable
-- Equal as sets: each array contains the other. The row lock and the state test keep a task failed once.
WITH due AS (
    SELECT id FROM tasks
    WHERE state IN {queued} AND required_tags @> $1::text[] AND required_tags <@ $1::text[]
    LIMIT $5 FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE tasks t SET state = $2, phase = NULL, error = $3, finished_at = $4, updated_at = $4
FROM due WHERE t.id = due.id RETURNING t.id, t.type

-- name: prune
WITH old AS (
    SELECT id FROM tasks
    WHERE finished_at < $1 AND state IN {terminal}
    LIMIT $2 FOR UPDATE SKIP LOCKED
), r AS (
    DELETE FROM results WHERE task_id IN (SELECT id FROM old)
), a AS (
    DELETE FROM attempts WHERE task_id IN (SELECT id FROM old)
), i AS (
    DELETE FROM task_inputs WHERE task_id IN (SELECT id FROM old)
), f AS (
    DELETE FROM artifacts WHERE task_id IN (SELECT id FROM old)
), t AS (
    DELETE FROM tasks WHERE id IN (SELECT id FROM old) RETURNING 1
)
SELECT count(*) FROM t

-- name: prune_nodes
-- Nodes not heard from since $1 are gone for good.
DELETE FROM nodes WHERE heartbeat_at < $1

-- name: prune_scans
WITH old AS (
    SELECT id FROM scans WHERE finished_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED
), j AS (
    DELETE FROM scan_jobs WHERE scan_id IN (SELECT id FROM old)
), i AS (
    DELETE FROM scan_inputs WHERE scan_id IN (SELECT id FROM old)
), s AS (
    DELETE FROM scans WHERE id IN (SELECT id FROM old) RETURNING 1
)
SELECT count(*) FROM s

-- name: takes_writes
-- A standby in recovery (a failover that left a node's URL on it), or a database set read-only, answers
-- every read and refuses every write.
SELECT pg_is_in_recovery(), current_setting('transaction_read_only')

-- name: node_lock
-- A session advisory lock: the process that holds it runs this node id.
SELECT pg_try_advisory_lock(hashtextextended($1, 0))

-- name: save_node
INSERT INTO nodes ({node_columns})
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
ON CONFLICT (node_id) DO UPDATE SET instance_id = $2, hostname = $3, pid = $4, version = $5, started_at = $6,
    heartbeat_at = $7, heartbeat_s = $8, stopped_at = $9, task_types = $10, tags = $11, max_workers = $12

-- name: list_nodes
SELECT {node_columns}
FROM nodes ORDER BY node_id

-- name: node
SELECT {node_columns}
FROM nodes WHERE node_id = $1
