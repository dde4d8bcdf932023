-- The schedules' statements: saved, listed and paused, and each due one fired in a transaction of its
-- own that holds its row.

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
