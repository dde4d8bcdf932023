-- The tasks' statements: submits, reads, cancels and retries. Each runs with search_path set to
-- the store's schema; the NOTIFY channel is the connection setting tidepool.channel, so no schema
-- object is needed to notify and the statements are the same for every schema.

-- name: get
-- One statement, one consistent snapshot: the task with its attempts, results and artifacts.
SELECT {task_columns},
    ARRAY(
        SELECT ROW({attempt_columns})
        FROM attempts a WHERE a.task_id = t.id ORDER BY a.number),
    ARRAY(
        SELECT ROW({result_columns})
        FROM results r WHERE r.task_id = t.id ORDER BY r.created_at, r.sequence),
    ARRAY(
        SELECT ROW({artifact_columns})
        FROM artifacts f WHERE f.task_id = t.id ORDER BY f.created_at, f.attempt_id, f.name)
FROM tasks t WHERE id = $1

-- name: list_tasks
-- Newest first, with attempts and without results; `where` joins the filters given with AND.
SELECT {task_columns},
    ARRAY(
        SELECT ROW({attempt_columns})
        FROM attempts a WHERE a.task_id = t.id ORDER BY a.number)
FROM tasks t WHERE {where} ORDER BY id DESC LIMIT {limit}

-- name: counts
SELECT state, count(*) FROM tasks
WHERE state IN {unfinished} GROUP BY state

-- name: organization_counts
SELECT organization, count(*) FROM tasks
WHERE state IN {unfinished} GROUP BY organization

-- name: insert_many
INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags,
                   idempotency_key, fingerprint, created_at, updated_at, available_at, organization, inputs)
VALUES ($1, $2, $3, $4, 'pending', $5, $6, $7, $8, $9, $10, $10, $11, $12, $13)

-- name: insert
-- One task, notified at commit; nothing when its idempotency key is taken already.
INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags,
                   idempotency_key, fingerprint, created_at, updated_at, available_at, organization, inputs)
VALUES ($1, $2, $3, $4, 'pending', $5, $6, $7, $8, $9, $10, $10, $11, $12, $13)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING {task_columns},
    pg_notify(current_setting('tidepool.channel'), '1')

-- name: hold_blobs
-- The blobs a submit names, held until its transaction ends: a pruning beside it skips them, or, having
-- locked them first, deletes them before this reads, which then finds them unknown.
SELECT sha256 FROM blobs WHERE sha256 = ANY($1::text[]) FOR KEY SHARE

-- name: insert_inputs
INSERT INTO task_inputs (task_id, name, sha256) SELECT * FROM unnest($1::text[], $2::text[], $3::text[])

-- name: notify
SELECT pg_notify(current_setting('tidepool.channel'), $1)

-- name: existing
SELECT {task_columns},
    fingerprint
FROM tasks WHERE idempotency_key = $1

-- name: keyed
SELECT idempotency_key, id, fingerprint FROM tasks WHERE idempotency_key = ANY($1::text[])

-- name: hold_queued
-- Submits that check the queue's limit take turns, until their transaction ends: two nodes cannot
-- both fill the last places.
SELECT pg_advisory_xact_lock(hashtextextended('tidepool.queued.' || current_schema(), 0))

-- name: queued
-- The tasks queued, counted no further than $1.
SELECT count(*) FROM (SELECT 1 FROM tasks WHERE state IN {queued} LIMIT $1) AS q

-- name: lock_state
SELECT state, type, scan_id, scan_index FROM tasks WHERE id = $1 FOR NO KEY UPDATE

-- name: cancel_queued
UPDATE tasks SET state = $1, phase = NULL, error = $4, finished_at = $2, updated_at = $2 WHERE id = $3

-- name: cancel_leased
UPDATE tasks SET state = $1, cancel_requested_at = $2, updated_at = $2 WHERE id = $3

-- name: retry
-- A new budget: attempt counts from zero again; attempts[].number keeps counting every row.
UPDATE tasks t SET state = $1, attempt = 0, interruptions = 0, available_at = $2, updated_at = $2,
    finished_at = NULL, error = NULL, progress = NULL
WHERE id = $3
RETURNING {task_columns},
    ARRAY(
        SELECT ROW({attempt_columns})
        FROM attempts a WHERE a.task_id = t.id ORDER BY a.number),
    pg_notify(current_setting('tidepool.channel'), '1')
