-- The workers' statements: claims, renewals, phase notes, results and endings. Every write carries
-- its fence (attempt id + lease token + live state + unexpired lease) in its WHERE clause.
--
-- Multi-row fenced writes take the leases as parallel arrays ($1..$3: task ids, attempt ids,
-- tokens, plus columns of their own) and lock their rows in id order first: two of them over the
-- same tasks (a renewal racing a grouped completion) then queue behind each other instead of
-- deadlocking. `state || ''` keeps the planner on the primary key: the statistics of a busy queue
-- are always stale, and on them it would scan the whole state index (every row that was ever
-- leased) for a few leases.

-- name: claim
SELECT * FROM claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)

-- name: renew
WITH l AS (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) AS l(id, attempt_id, token)),
locked AS MATERIALIZED (
    SELECT t.id FROM tasks t
    JOIN l ON t.id = l.id AND t.lease_attempt_id = l.attempt_id AND t.lease_token = l.token
    WHERE (t.state || '') IN {working} AND t.lease_expires_at > $4
    ORDER BY t.id FOR NO KEY UPDATE OF t
)
UPDATE tasks t SET lease_expires_at = $5 FROM locked WHERE t.id = locked.id
RETURNING t.lease_attempt_id

-- name: set_phase
WITH l AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[])
        AS l(id, attempt_id, token, phase, progress)
), locked AS MATERIALIZED (
    SELECT t.id, l.phase, l.progress FROM tasks t
    JOIN l ON t.id = l.id AND t.lease_attempt_id = l.attempt_id AND t.lease_token = l.token
    WHERE (t.state || '') IN {working} AND t.lease_expires_at > $6
    ORDER BY t.id FOR NO KEY UPDATE OF t
), noted AS (
    UPDATE tasks t SET phase = locked.phase, progress = coalesce(locked.progress, t.progress),
        updated_at = $6, state = 'running'
    FROM locked WHERE t.id = locked.id RETURNING t.lease_attempt_id
), started AS (
    UPDATE attempts a SET status = 'running' FROM noted
    WHERE a.id = noted.lease_attempt_id AND a.status = 'leased'
)
SELECT lease_attempt_id FROM noted

-- name: complete
-- Bare successes of many workers, each fenced at its own end time.
WITH l AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::float8[], $5::text[])
        AS l(id, attempt_id, token, now, progress)
), locked AS MATERIALIZED (
    SELECT t.id, l.now, l.progress FROM tasks t
    JOIN l ON t.id = l.id AND t.lease_attempt_id = l.attempt_id AND t.lease_token = l.token
    WHERE (t.state || '') IN {working} AND t.lease_expires_at > l.now
      AND t.scan_id IS NULL  -- a scan step's success moves its scan too: the one-by-one path
    ORDER BY t.id FOR NO KEY UPDATE OF t
), done AS (
    UPDATE tasks t SET state = 'completed', phase = NULL, progress = coalesce(locked.progress, t.progress),
        error = NULL, updated_at = locked.now, finished_at = locked.now, lease_token = NULL
    FROM locked WHERE t.id = locked.id RETURNING t.lease_attempt_id, locked.now
), succeeded AS (
    UPDATE attempts a SET status = 'succeeded', finished_at = done.now FROM done
    WHERE a.id = done.lease_attempt_id
)
SELECT lease_attempt_id FROM done

-- name: cancelling
-- Of the leases a multi-row write did not take, those whose task is being cancelled.
SELECT l.attempt_id FROM unnest($1::text[], $2::text[], $3::text[]) AS l(id, attempt_id, token)
JOIN tasks t ON t.id = l.id AND t.lease_attempt_id = l.attempt_id AND t.lease_token = l.token
WHERE t.state = 'cancelling'

-- name: why_lost
SELECT state FROM tasks WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3

-- name: record_result
-- FOR SHARE holds off an expiry or a cancel until the result is in, or sees theirs first.
WITH fenced AS (
    SELECT id FROM tasks WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3
      AND state IN {working} AND lease_expires_at > $4
    FOR SHARE
), stored AS (
    INSERT INTO results (idempotency_key, task_id, attempt_id, plugin, sequence, sha256, final, payload,
                         created_at)
    SELECT $5, id, $2, $6, $7, $8, $9, $10, $4 FROM fenced
    ON CONFLICT (idempotency_key) DO NOTHING RETURNING 1
)
SELECT (SELECT count(*) FROM fenced), (SELECT count(*) FROM stored)

-- name: earlier_result
SELECT plugin, sequence, idempotency_key, sha256, final, payload, attempt_id FROM results WHERE idempotency_key = $1

-- name: ending_row
SELECT state, attempt, max_attempts, interruptions, lease_expires_at, scan_id, scan_index FROM tasks
WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3 FOR NO KEY UPDATE

-- name: ended_at
-- How an attempt stands if it ended at exactly $2.
SELECT t.state, a.status FROM attempts a JOIN tasks t ON t.id = a.task_id WHERE a.id = $1 AND a.finished_at = $2

-- name: write_ends
-- How attempts ended, decided in Python (lifecycle.decide_end), written for many at once; the
-- caller holds their task rows locked.
WITH e AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int[],
                         $7::float8[], $8::float8[], $9::int[], $10::text[], $11::text[])
        AS e(task_id, attempt_id, state, status, error, uncount, available_at, finished_at, exit_status,
             stderr_tail, progress)
), ended AS (
    UPDATE attempts a SET status = e.status, finished_at = $12, error = e.error,
        exit_status = e.exit_status, stderr_tail = e.stderr_tail
    FROM e WHERE a.id = e.attempt_id
)
UPDATE tasks t SET state = e.state, phase = NULL, progress = coalesce(e.progress, t.progress), error = e.error,
    updated_at = $12,
    attempt = t.attempt - e.uncount, interruptions = t.interruptions + e.uncount,
    available_at = coalesce(e.available_at, t.available_at), finished_at = e.finished_at,
    lease_token = NULL
FROM e WHERE t.id = e.task_id
