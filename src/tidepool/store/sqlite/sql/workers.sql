-- The SQLite store's statements of the worker registry (workers.py), by name: the remote workers' records,
-- their live attempts, and the cancels of what they hold. `{marks}` is filled per call.

-- name: node
-- A node of the fleet by this id: an identity may not be one (the attempts could not tell them apart).
SELECT {node_columns} FROM nodes WHERE node_id = ?

-- name: worker
SELECT {worker_columns} FROM workers WHERE id = ?

-- name: workers
SELECT {worker_columns} FROM workers ORDER BY id

-- name: save_worker
INSERT OR REPLACE INTO workers ({worker_columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)

-- name: live
SELECT count(*) FROM tasks WHERE node_id = ? AND state IN {active}

-- name: lives
SELECT node_id, count(*) FROM tasks WHERE state IN {active} AND node_id IN (SELECT id FROM workers) GROUP BY node_id

-- name: held_by
-- A worker's active tasks (the caller leaves the cancelling ones be); `{organizations}` narrows them.
SELECT id, lease_attempt_id, type, state FROM tasks
WHERE node_id = ? AND state IN {active} {organizations}

-- name: cancel_held
-- A held task of the worker -> cancelling, as a task cancel moves it.
UPDATE tasks SET state = ?, cancel_requested_at = ?, updated_at = ? WHERE id = ?

-- name: cancelling_of
-- The attempts of a worker that a cancel moved to cancelling: its answers tell it to stop them.
SELECT lease_attempt_id FROM tasks
WHERE node_id = ? AND state IN {active} AND state = 'cancelling' AND lease_attempt_id IS NOT NULL

-- name: attempt_owners
SELECT id, node_id FROM attempts WHERE id IN ({marks})
