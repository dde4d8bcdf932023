-- The SQLite store's statements of schedules (schedules.py), by name: saved, listed, paused, their ticks fired.

-- name: schedule
SELECT {schedule_columns} FROM schedules WHERE name = ?

-- name: schedules
SELECT {schedule_columns} FROM schedules ORDER BY name

-- name: due_schedules
SELECT {schedule_columns} FROM schedules WHERE paused = 0 AND next_run_at <= ?

-- name: save_schedule
INSERT OR REPLACE INTO schedules ({schedule_columns}) VALUES (?, ?, ?, ?, ?, ?, ?)

-- name: delete_schedule
-- With a config node given, only while that node's config still defines the schedule.
DELETE FROM schedules WHERE name = ? AND (? IS NULL OR json_extract(spec, '$.config_node') = ?)

-- name: key_used
SELECT 1 FROM tasks WHERE idempotency_key = ?

-- name: started_scan
-- What a profile schedule started last: a scan, while it has not ended.
SELECT state FROM scans WHERE id = ?

-- name: started_task
SELECT state FROM tasks WHERE id = ?
