-- The reconciler's passes. Each takes only rows no other node holds (SKIP LOCKED); those that end
-- tasks take at most as many rows per transaction as their last parameter says: bounded locks and
-- WAL per step.

-- name: expiring
SELECT state, attempt, max_attempts, interruptions, id, lease_attempt_id, lease_token, type, scan_id, scan_index
FROM tasks WHERE state IN {active} AND lease_expires_at <= $1
LIMIT $2 FOR NO KEY UPDATE SKIP LOCKED

-- name: expiring_of_node
-- Every lease of a node's other processes (a restart of that node), expired or not.
SELECT state, attempt, max_attempts, interruptions, id, lease_attempt_id, lease_token, type, scan_id, scan_index
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
), t AS (
    DELETE FROM tasks WHERE id IN (SELECT id FROM old) RETURNING 1
)
SELECT count(*) FROM t

-- name: prune_nodes
-- Nodes not heard from since $1 are gone for good.
DELETE FROM nodes WHERE heartbeat_at < $1
