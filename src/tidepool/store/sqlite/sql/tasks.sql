-- The SQLite store's statements of the queue's tasks (tasks.py), by name: submits, reads, cancels, retries.
-- `{marks}` is filled per call: as many `?` as the call has items.

-- name: count_queued
SELECT count(*) FROM tasks WHERE state IN {queued}

-- name: task_by_key
SELECT {task_columns}, fingerprint FROM tasks WHERE idempotency_key = ?

-- name: tasks_by_keys
SELECT idempotency_key, id, fingerprint FROM tasks WHERE idempotency_key IN ({marks})

-- name: insert_task
INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags, idempotency_key,
                   fingerprint, created_at, updated_at, available_at, organization, inputs)
VALUES (?, ?, ?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)

-- name: known_blobs
SELECT sha256 FROM blobs WHERE sha256 IN ({marks})

-- name: insert_input
INSERT INTO task_inputs (task_id, name, sha256) VALUES (?, ?, ?)

-- name: artifacts_of_task
SELECT {artifact_columns} FROM artifacts WHERE task_id = ? ORDER BY created_at, attempt_id, name

-- name: task_state
SELECT state, type, scan_id, scan_index FROM tasks WHERE id = ?

-- name: cancel_queued
UPDATE tasks SET state = ?, phase = NULL, error = ?, finished_at = ?, updated_at = ? WHERE id = ?

-- name: cancel_held
UPDATE tasks SET state = ?, cancel_requested_at = ?, updated_at = ? WHERE id = ?

-- name: retry
-- A new budget: attempt counts from zero again; attempts[].number keeps counting every row.
UPDATE tasks SET state = ?, attempt = 0, interruptions = 0, available_at = ?, updated_at = ?, finished_at = NULL,
                 error = NULL, progress = NULL
WHERE id = ?

-- name: task
SELECT {task_columns} FROM tasks WHERE id = ?

-- name: results_of_task
SELECT {result_columns} FROM results WHERE task_id = ? ORDER BY created_at, sequence

-- name: attempts_of_tasks
SELECT {attempt_columns} FROM attempts WHERE task_id IN ({marks}) ORDER BY task_id, number

-- name: list_tasks
-- `{where}`: the filters given, joined by AND.
SELECT {task_columns} FROM tasks WHERE {where} ORDER BY id DESC LIMIT ?

-- name: counts
SELECT state, count(*) FROM tasks WHERE state IN {unfinished} GROUP BY state

-- name: organization_counts
SELECT organization, count(*) FROM tasks WHERE state IN {unfinished} GROUP BY organization
