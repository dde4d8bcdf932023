-- The SQLite store's statements of the reconciler's passes and the fleet of nodes (upkeep.py), by name.

-- name: expiring
SELECT state, attempt, max_attempts, interruptions, lease_expires_at, id, lease_attempt_id, lease_token, type,
       scan_id, scan_index
FROM tasks WHERE state IN {active} AND lease_expires_at <= ?

-- name: expiring_of_node
-- Every lease of a node's other processes: the ones that ran before this one.
SELECT state, attempt, max_attempts, interruptions, lease_expires_at, id, lease_attempt_id, lease_token, type,
       scan_id, scan_index
FROM tasks WHERE state IN {active} AND node_id = ? AND lease_instance IS NOT ?

-- name: deadlines
-- The run deadlines of the attempts the expiry found, those that have one.
SELECT id, deadline_at FROM attempts WHERE id IN ({marks}) AND deadline_at IS NOT NULL

-- name: promote_due
UPDATE tasks SET state = 'pending', updated_at = ? WHERE state = 'retry_wait' AND available_at <= ?

-- name: cancels_due
SELECT id, lease_attempt_id, type, scan_id, scan_index FROM tasks WHERE state = 'cancelling' AND cancel_requested_at <= ?

-- name: cancel_attempt
UPDATE attempts SET status = 'cancelled', finished_at = ?, error = ? WHERE id = ?

-- name: cancel_task
UPDATE tasks SET state = ?, phase = NULL, error = ?, finished_at = ?, updated_at = ?, lease_token = NULL
WHERE id = ?

-- name: prune_results
DELETE FROM results WHERE task_id IN (SELECT id FROM tasks WHERE finished_at < ? AND state IN {terminal})

-- name: prune_attempts
DELETE FROM attempts WHERE task_id IN (SELECT id FROM tasks WHERE finished_at < ? AND state IN {terminal})

-- name: prune_inputs
DELETE FROM task_inputs WHERE task_id IN (SELECT id FROM tasks WHERE finished_at < ? AND state IN {terminal})

-- name: prune_artifacts
DELETE FROM artifacts WHERE task_id IN (SELECT id FROM tasks WHERE finished_at < ? AND state IN {terminal})

-- name: prune_scan_inputs
DELETE FROM scan_inputs WHERE scan_id IN (SELECT id FROM scans WHERE finished_at < ?)

-- name: prune_nodes
DELETE FROM nodes WHERE heartbeat_at < ?

-- name: prune_jobs
DELETE FROM scan_jobs WHERE scan_id IN (SELECT id FROM scans WHERE finished_at < ?)

-- name: prune_scans
DELETE FROM scans WHERE finished_at < ?

-- name: prune_tasks
DELETE FROM tasks WHERE id IN (SELECT id FROM tasks WHERE finished_at < ? AND state IN {terminal})

-- name: queued_tag_sets
SELECT DISTINCT required_tags FROM tasks WHERE state IN {queued} AND required_tags != '[]'

-- name: fail_unserviceable
-- required_tags is stored as a sorted JSON list, so equal sets are equal texts.
UPDATE tasks SET state = ?, phase = NULL, error = ?, finished_at = ?, updated_at = ?
WHERE state IN {queued} AND required_tags = ? RETURNING id, type, scan_id, scan_index

-- name: node
SELECT {node_columns} FROM nodes WHERE node_id = ?

-- name: nodes
SELECT {node_columns} FROM nodes ORDER BY node_id

-- name: save_node
INSERT OR REPLACE INTO nodes ({node_columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
