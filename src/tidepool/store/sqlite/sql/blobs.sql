-- The SQLite store's statements of blobs and artifacts (blobs.py), by name. A blob's bytes are a file of the
-- blob directory; its row here is what makes it visible, and what a task's inputs and artifacts name.

-- name: blob
SELECT sha256, size, created_at FROM blobs WHERE sha256 = ?

-- name: insert_blob
INSERT INTO blobs (sha256, size, created_at) VALUES (?, ?, ?)

-- name: touch_blob
-- A blob put again waits for its submit as long as a new one would.
UPDATE blobs SET created_at = max(created_at, ?) WHERE sha256 = ? RETURNING sha256, size, created_at

-- name: holder
-- The leased task's state and holder, behind the lease's fence.
SELECT state, node_id FROM tasks WHERE id = ? AND lease_attempt_id = ? AND lease_token = ? AND lease_expires_at > ?

-- name: held
SELECT 1 FROM tasks WHERE id = ? AND lease_attempt_id = ? AND lease_token = ?

-- name: task_exists
SELECT 1 FROM tasks WHERE id = ?

-- name: is_input
SELECT 1 FROM task_inputs WHERE task_id = ? AND sha256 = ? LIMIT 1

-- name: artifact_by_name
SELECT {artifact_columns} FROM artifacts WHERE attempt_id = ? AND name = ?

-- name: artifact_counts
SELECT count(*), coalesce(sum(size), 0) FROM artifacts WHERE attempt_id = ?

-- name: insert_artifact
INSERT INTO artifacts (attempt_id, task_id, name, sha256, size, content_type, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)

-- name: leased_blob
SELECT EXISTS (
    SELECT 1 FROM task_inputs i JOIN tasks t ON t.id = i.task_id
    WHERE i.sha256 = ? AND t.node_id = ? AND t.state IN {working} AND t.lease_expires_at > ?)

-- name: prune_blobs
-- Old blobs no task or scan names; their files are unlinked once this commits.
DELETE FROM blobs WHERE created_at < ?
  AND NOT EXISTS (SELECT 1 FROM task_inputs i WHERE i.sha256 = blobs.sha256)
  AND NOT EXISTS (SELECT 1 FROM artifacts a WHERE a.sha256 = blobs.sha256)
  AND NOT EXISTS (SELECT 1 FROM scan_inputs s WHERE s.sha256 = blobs.sha256)
RETURNING sha256
