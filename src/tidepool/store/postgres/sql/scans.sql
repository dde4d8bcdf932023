-- The scans' statements. A scan's row is locked (FOR UPDATE) by every transaction that moves it, after
-- the row of the task it moves with when there is one: a task's end locks its task first, and so does
-- a scan's cancel, so the two queue behind each other instead of deadlocking.

-- name: lock_scan
SELECT {scan_columns} FROM scans WHERE id = $1 FOR UPDATE

-- name: scan
SELECT {scan_columns} FROM scans WHERE id = $1

-- name: jobs
-- Jobs with their latest tasks' state, attempts started (an interrupted one included) and error (NULL once
-- the task is pruned), by scan and index.
SELECT j.scan_id, j.idx, j.step, j.state, j.task_id, j.tasks, j.scope_before, t.state, t.attempt_rows, t.error
FROM scan_jobs j LEFT JOIN tasks t ON t.id = j.task_id WHERE j.scan_id = ANY($1::text[]) ORDER BY j.scan_id, j.idx

-- name: scan_scope
SELECT scope FROM scans WHERE id = $1

-- name: scan_by_key
SELECT id, fingerprint FROM scans WHERE idempotency_key = $1

-- name: insert_scan
INSERT INTO scans ({scan_columns}, fingerprint) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
ON CONFLICT (idempotency_key) DO NOTHING RETURNING id

-- name: insert_jobs
INSERT INTO scan_jobs (scan_id, idx, step, state)
SELECT $1, idx - 1, step, 'waiting' FROM unnest($2::text[]) WITH ORDINALITY AS s(step, idx)

-- name: insert_step
-- A step's task, notified at commit like any submit.
INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags, idempotency_key,
                   fingerprint, created_at, updated_at, available_at, organization, scan_id, scan_index, scan_retry,
                   inputs)
VALUES ($1, $2, $3, $4, 'pending', $5, $6, $7, NULL, '', $8, $8, $8, $9, $10, $11, $12, $13)
RETURNING pg_notify(current_setting('tidepool.channel'), '1')

-- name: insert_scan_inputs
INSERT INTO scan_inputs (scan_id, name, sha256) SELECT $1, * FROM unnest($2::text[], $3::text[])

-- name: scan_inputs
SELECT scan_id, name, sha256 FROM scan_inputs WHERE scan_id = ANY($1::text[]) ORDER BY scan_id, name

-- name: job_artifacts
-- The artifacts of the scans' jobs' latest tasks, oldest first: a later attempt's of one name wins.
SELECT j.scan_id, j.idx, a.name, a.sha256 FROM scan_jobs j JOIN artifacts a ON a.task_id = j.task_id
WHERE j.scan_id = ANY($1::text[]) ORDER BY j.scan_id, j.idx, a.created_at, a.attempt_id

-- name: start_job
UPDATE scan_jobs SET state = 'started', task_id = $1, tasks = tasks + 1, scope_before = $2
WHERE scan_id = $3 AND idx = $4

-- name: set_job
UPDATE scan_jobs SET state = $1 WHERE scan_id = $2 AND idx = $3

-- name: move_scan
UPDATE scans SET state = $1, scope = $2, updated_at = $3, finished_at = $4 WHERE id = $5

-- name: cancel_scan
UPDATE scans SET cancel_requested_at = $1, updated_at = $1 WHERE id = $2

-- name: retry_scan
UPDATE scans SET state = 'running', scope = $1, updated_at = $2, finished_at = NULL, cancel_requested_at = NULL
WHERE id = $3

-- name: list_scans
-- The filters given (`where`) joined by AND; first_job_queued, a condition without comments (it is
-- inlined), is a running scan nothing of which has run: its first job's first task is queued and has started
-- no attempt (one job is started at a time, so every later one is waiting).
-- The page's size is the `limit` parameter.
SELECT {scan_columns} FROM scans s WHERE {where} ORDER BY id DESC LIMIT {limit}

-- name: first_job_queued
EXISTS (SELECT 1 FROM scan_jobs j JOIN tasks t ON t.id = j.task_id
        WHERE j.scan_id = s.id AND j.idx = 0 AND j.state = 'started' AND j.tasks = 1 AND t.attempt_rows = 0
          AND t.state IN {queued})

-- name: stalled_scans
-- Running scans without a live task: a job whose task ended without its end applied, or none started.
SELECT s.id FROM scans s
WHERE s.state = 'running' AND NOT EXISTS (
    SELECT 1 FROM scan_jobs j JOIN tasks t ON t.id = j.task_id
    WHERE j.scan_id = s.id AND j.state = 'started' AND t.state NOT IN {terminal})
LIMIT $1 FOR UPDATE OF s SKIP LOCKED
