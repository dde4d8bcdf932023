-- The fleet's statements: the server's own state, the node registry, the node lock, and schedules.

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

-- name: save_schedule
INSERT INTO schedules ({schedule_columns})
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (name) DO UPDATE SET spec = $2, paused = $3, next_tick_at = $4, next_run_at = $5,
    last_run_at = $6, last_task_id = $7

-- name: list_schedules
SELECT {schedule_columns} FROM schedules ORDER BY name

-- name: locked_schedule
SELECT {schedule_columns} FROM schedules
WHERE name = $1 FOR UPDATE

-- name: delete_schedule
-- With $2, only while that node's config defines it.
DELETE FROM schedules WHERE name = $1 AND ($2::text IS NULL OR spec::jsonb ->> 'config_node' = $2) RETURNING 1

-- name: due_schedules
SELECT name, spec FROM schedules WHERE NOT paused AND next_run_at <= $1

-- name: due_schedule
-- Each due schedule is fired in a transaction of its own; a node skips the ones another is firing.
SELECT {schedule_columns} FROM schedules
WHERE name = $1 AND NOT paused AND next_run_at <= $2
FOR UPDATE SKIP LOCKED

-- name: keys_taken
SELECT idempotency_key FROM tasks WHERE idempotency_key = ANY($1::text[])

-- name: active
-- Whether a schedule's last task has not ended yet.
SELECT state IN {terminal} IS FALSE FROM tasks WHERE id = $1
