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

-- name: begin_steps
-- The transaction of lock_steps and steps_succeeded, which read and write a few rows of big tables by key: their
-- joins to the arrays they are given go by index. On the statistics of a young or busy queue the planner would
-- otherwise hash-join whole tables to them (every task, job and scan read for each round's few).
BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off

-- name: lock_steps
-- The bare step successes of a grouped finish, locked behind their fences (as `complete` does for plain tasks)
-- in task id order; then, once every one of those task rows is held (the array_agg's subquery runs to its end
-- before the scans are read), their scans' rows in scan id order: the task rows before the scan rows, as every
-- transaction that moves a scan takes them. Each row: the step's attempt id, task id and job index, its
-- scan's columns (NULL when the scan is gone), its scan's jobs (the `jobs` columns, by index), the scan's
-- inputs and its jobs' artifacts (`scan_inputs` and `job_artifacts`). The tasks and artifacts of each scan's jobs
-- are looked up by key (LATERAL, kept apart by OFFSET 0): on the statistics of a young or busy queue the
-- planner would otherwise join them whole, reading the tasks table once per scan.
WITH l AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::float8[]) AS l(id, attempt_id, token, now)
), locked AS MATERIALIZED (
    SELECT t.id, t.lease_attempt_id, t.scan_id, t.scan_index FROM tasks t
    JOIN l ON t.id = l.id AND t.lease_attempt_id = l.attempt_id AND t.lease_token = l.token
    WHERE (t.state || '') IN {working} AND t.lease_expires_at > l.now AND t.scan_id IS NOT NULL
    ORDER BY t.id FOR NO KEY UPDATE OF t
), held AS MATERIALIZED (
    SELECT {scan_columns} FROM scans WHERE id = ANY((SELECT array_agg(scan_id) FROM locked)::text[])
    ORDER BY id FOR UPDATE
)
SELECT locked.lease_attempt_id, locked.id, locked.scan_index, held.*,
    ARRAY(SELECT ROW(j.scan_id, j.idx, j.step, j.state, j.task_id, j.tasks, j.scope_before, t.state,
                     t.attempt_rows, t.error)
          FROM scan_jobs j LEFT JOIN LATERAL (SELECT * FROM tasks t WHERE t.id = j.task_id OFFSET 0) t ON true
          WHERE j.scan_id = held.id ORDER BY j.idx),
    ARRAY(SELECT ROW(i.name, i.sha256) FROM scan_inputs i WHERE i.scan_id = held.id ORDER BY i.name),
    ARRAY(SELECT ROW(j.idx, a.name, a.sha256)
          FROM scan_jobs j CROSS JOIN LATERAL (SELECT * FROM artifacts a WHERE a.task_id = j.task_id OFFSET 0) a
          WHERE j.scan_id = held.id ORDER BY j.idx, a.created_at, a.attempt_id)
FROM locked LEFT JOIN held ON held.id = locked.scan_id

-- name: steps_succeeded
-- What lock_steps' steps' ends write, each kind once for the lot: the tasks completed and their attempts
-- succeeded, the jobs that change (a started one with its task, the others their state), the next steps'
-- tasks and their inputs, the scans moved on; one notification at commit for the tasks made.
WITH e AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::float8[], $4::text[]) AS e(task_id, attempt_id, now, progress)
), done AS (
    UPDATE tasks t SET state = 'completed', phase = NULL, progress = coalesce(e.progress, t.progress), error = NULL,
        updated_at = e.now, finished_at = e.now, lease_token = NULL
    FROM e WHERE t.id = e.task_id
), succeeded AS (
    UPDATE attempts a SET status = 'succeeded', finished_at = e.now FROM e WHERE a.id = e.attempt_id
), jobs AS (
    UPDATE scan_jobs j SET state = v.state, task_id = coalesce(v.task_id, j.task_id),
        tasks = j.tasks + (v.task_id IS NOT NULL)::integer, scope_before = coalesce(v.scope_before, j.scope_before)
    FROM unnest($5::text[], $6::integer[], $7::text[], $8::text[], $9::text[])
        AS v(scan_id, idx, state, task_id, scope_before)
    WHERE j.scan_id = v.scan_id AND j.idx = v.idx
), steps AS (
    INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags, idempotency_key,
                       fingerprint, created_at, updated_at, available_at, organization, scan_id, scan_index,
                       scan_retry, inputs)
    SELECT s.id, s.type, s.payload, s.priority, 'pending', s.max_attempts, s.timeout_s,
        ARRAY(SELECT jsonb_array_elements_text(s.tags::jsonb)), NULL, '', s.now, s.now, s.now, s.organization,
        s.scan_id, s.scan_index, s.scan_retry, s.inputs
    FROM unnest($10::text[], $11::text[], $12::text[], $13::bigint[], $14::integer[], $15::float8[], $16::text[],
                $17::float8[], $18::text[], $19::text[], $20::integer[], $21::integer[], $22::text[])
        AS s(id, type, payload, priority, max_attempts, timeout_s, tags, now, organization, scan_id, scan_index,
             scan_retry, inputs)
    RETURNING 1
), files AS (
    INSERT INTO task_inputs (task_id, name, sha256) SELECT * FROM unnest($23::text[], $24::text[], $25::text[])
), moved AS (
    UPDATE scans s SET state = m.state, scope = m.scope, updated_at = m.now, finished_at = m.finished_at
    FROM unnest($26::text[], $27::text[], $28::text[], $29::float8[], $30::float8[])
        AS m(id, state, scope, now, finished_at)
    WHERE s.id = m.id
)
SELECT pg_notify(current_setting('tidepool.channel'), count(*)::text) FROM steps HAVING count(*) > 0
