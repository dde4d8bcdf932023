-- The PostgreSQL store's statements of blobs and artifacts (blobs.py), by name.

-- name: blob
SELECT sha256, size, created_at FROM blobs WHERE sha256 = $1

-- name: put_blob
-- A blob's row; one there already is touched: it waits for its submit as long as a new one would.
INSERT INTO blobs (sha256, size, created_at) VALUES ($1, $2, $3)
ON CONFLICT (sha256) DO UPDATE SET created_at = greatest(blobs.created_at, excluded.created_at)
RETURNING sha256, size, created_at, xmax = 0 AS created

-- name: insert_chunk
INSERT INTO blob_chunks (sha256, seq, data) VALUES ($1, $2, $3)

-- name: name_chunks
UPDATE blob_chunks SET sha256 = $2 WHERE sha256 = $1

-- name: drop_chunks
DELETE FROM blob_chunks WHERE sha256 = $1

-- name: chunk
SELECT substring(data FROM $3 FOR $4) FROM blob_chunks WHERE sha256 = $1 AND seq = $2

-- name: holder
-- The leased task's state and holder behind the lease's fence, its row locked: an attempt's artifacts
-- are counted against its quota one writer at a time.
SELECT state, node_id FROM tasks
WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3 AND lease_expires_at > $4 AND state IN {working}
FOR NO KEY UPDATE

-- name: held
SELECT EXISTS (SELECT 1 FROM tasks WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3),
       EXISTS (SELECT 1 FROM task_inputs WHERE task_id = $1 AND sha256 = $4)

-- name: task_exists
SELECT EXISTS (SELECT 1 FROM tasks WHERE id = $1)

-- name: artifacts_of_task
SELECT {artifact_columns} FROM artifacts WHERE task_id = $1 ORDER BY created_at, attempt_id, name

-- name: artifact_by_name
SELECT {artifact_columns} FROM artifacts WHERE attempt_id = $1 AND name = $2

-- name: artifact_counts
SELECT count(*), coalesce(sum(size), 0) FROM artifacts WHERE attempt_id = $1

-- name: hold_blob
-- Held until the artifact's transaction ends, as a submit holds its inputs' blobs.
SELECT size FROM blobs WHERE sha256 = $1 FOR KEY SHARE

-- name: insert_artifact
INSERT INTO artifacts (attempt_id, task_id, name, sha256, size, content_type, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7)

-- name: leased_blob
SELECT EXISTS (
    SELECT 1 FROM task_inputs i JOIN tasks t ON t.id = i.task_id
    WHERE i.sha256 = $1 AND t.node_id = $2 AND t.state IN {working} AND t.lease_expires_at > $3)

-- name: prune_blobs
-- Old blobs no task or scan names, with their chunks. A blob a submit in flight holds is skipped; one that
-- a submit committed to after this statement's snapshot is refused by the foreign keys (the pass fails,
-- the next one judges it anew).
WITH gone AS (
    SELECT b.sha256 FROM blobs b
    WHERE b.created_at < $1
      AND NOT EXISTS (SELECT 1 FROM task_inputs i WHERE i.sha256 = b.sha256)
      AND NOT EXISTS (SELECT 1 FROM artifacts a WHERE a.sha256 = b.sha256)
      AND NOT EXISTS (SELECT 1 FROM scan_inputs s WHERE s.sha256 = b.sha256)
    FOR UPDATE SKIP LOCKED
), chunks AS (
    DELETE FROM blob_chunks c USING gone WHERE c.sha256 = gone.sha256
)
DELETE FROM blobs b USING gone WHERE b.sha256 = gone.sha256 RETURNING b.sha256
