-- The SQLite store's statements of scans (scans.py), by name: a scan's rows move in the transaction that ends
-- its step's task, or in a call of its own. `{marks}` and `{rows}` are filled per call.

-- name: scan
SELECT {scan_columns} FROM scans WHERE id = ?

-- name: jobs
-- A scan's jobs with their latest tasks' state, attempts started (an interrupted one included: it has its
-- row) and error (NULL once the task is pruned).
SELECT j.scan_id, j.idx, j.step, j.state, j.task_id, j.tasks, j.scope_before, t.state,
       (SELECT count(*) FROM attempts a WHERE a.task_id = t.id), t.error
FROM scan_jobs j LEFT JOIN tasks t ON t.id = j.task_id WHERE j.scan_id IN ({marks}) ORDER BY j.scan_id, j.idx

-- name: scan_scope
SELECT scope FROM scans WHERE id = ?

-- name: scan_by_key
SELECT id, fingerprint FROM scans WHERE idempotency_key = ?

-- name: insert_scan
INSERT INTO scans ({scan_columns}, fingerprint) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)

-- name: insert_job
INSERT INTO scan_jobs (scan_id, idx, step, state) VALUES (?, ?, ?, 'waiting')

-- name: insert_step
INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags, idempotency_key,
                   fingerprint, created_at, updated_at, available_at, organization, scan_id, scan_index, scan_retry,
                   inputs)
VALUES (?, ?, ?, ?, 'pending', ?, ?, ?, NULL, '', ?, ?, ?, ?, ?, ?, ?, ?)

-- name: insert_scan_input
INSERT INTO scan_inputs (scan_id, name, sha256) VALUES (?, ?, ?)

-- name: scan_inputs
SELECT scan_id, name, sha256 FROM scan_inputs WHERE scan_id IN ({marks}) ORDER BY scan_id, name

-- name: job_artifacts
-- The artifacts of the scans' jobs' latest tasks, oldest first: a later attempt's of one name wins.
SELECT j.scan_id, j.idx, a.name, a.sha256 FROM scan_jobs j JOIN artifacts a ON a.task_id = j.task_id
WHERE j.scan_id IN ({marks}) ORDER BY j.scan_id, j.idx, a.created_at, a.attempt_id

-- name: start_job
UPDATE scan_jobs SET state = 'started', task_id = ?, tasks = tasks + 1, scope_before = ? WHERE scan_id = ? AND idx = ?

-- name: set_job
UPDATE scan_jobs SET state = ? WHERE scan_id = ? AND idx = ?

-- name: move_scan
UPDATE scans SET state = ?, scope = ?, updated_at = ?, finished_at = ? WHERE id = ?

-- name: cancel_scan
UPDATE scans SET cancel_requested_at = ?, updated_at = ? WHERE id = ?

-- name: retry_scan
UPDATE scans SET state = 'running', scope = ?, updated_at = ?, finished_at = NULL, cancel_requested_at = NULL
WHERE id = ?

-- name: list_scans
-- The filters given (`where`) joined by AND; first_job_queued, a condition without comments (it is
-- inlined), is a running scan nothing of which has run: its first job's first task is queued and has started
-- no attempt (one job is started at a time, so every later one is waiting).
SELECT {scan_columns} FROM scans s WHERE {where} ORDER BY id DESC LIMIT ?

-- name: first_job_queued
EXISTS (SELECT 1 FROM scan_jobs j JOIN tasks t ON t.id = j.task_id
        WHERE j.scan_id = s.id AND j.idx = 0 AND j.state = 'started' AND j.tasks = 1 AND t.state IN {queued}
          AND NOT EXISTS (SELECT 1 FROM attempts a WHERE a.task_id = t.id))

-- name: stalled_scans
-- Running scans without a live task: a job whose task ended without its end applied, or none started.
SELECT s.id FROM scans s INDEXED BY scans_state
WHERE s.state = 'running' AND NOT EXISTS (
    SELECT 1 FROM scan_jobs j JOIN tasks t ON t.id = j.task_id
    WHERE j.scan_id = s.id AND j.state = 'started' AND t.state NOT IN {terminal})

-- name: complete_steps
-- Step successes of one writer round completed together behind their fences (as `complete` does for plain
-- tasks), returning what finds each one's scan.
UPDATE tasks SET state = 'completed', phase = NULL, progress = coalesce(v.column5, progress), error = NULL,
                 updated_at = v.column4, finished_at = v.column4, lease_token = NULL
FROM (VALUES {rows}) AS v
WHERE tasks.id = v.column1 AND tasks.lease_attempt_id = v.column2 AND tasks.lease_token = v.column3
  AND +tasks.state IN {working} AND tasks.lease_expires_at > v.column4 AND tasks.scan_id IS NOT NULL
RETURNING tasks.lease_attempt_id, tasks.scan_id, tasks.scan_index

-- name: complete_steps_row
(?, ?, ?, ?, ?)

-- name: attempts_succeeded
UPDATE attempts SET status = 'succeeded', finished_at = v.column2 FROM (VALUES {rows}) AS v
WHERE attempts.id = v.column1

-- name: attempts_succeeded_row
(?, ?)

-- name: scans
SELECT {scan_columns} FROM scans WHERE id IN ({marks})
