-- The leases' statements: the claim function and claims, renewals, phase notes, results and endings.
-- Every write carries its fence (attempt id + lease token + live state + unexpired lease) in its WHERE
-- clause.
--
-- Multi-row fenced writes take the leases as parallel arrays ($1..$3: task ids, attempt ids,
-- tokens, plus columns of their own) and lock their rows in id order first: two of them over the
-- same tasks (a renewal racing a grouped completion) then queue behind each other instead of
-- deadlocking. `state || ''` keeps the planner on the primary key: the statistics of a busy queue
-- are always stale, and on them it would scan the whole state index (every row that was ever
-- leased) for a few leases.

-- name: claim_function
-- The claim function, (re)defined after the numbered migrations whenever a schema is migrated, so its one
-- definition is this section: a change to it comes with a new schema version, which a fleet's nodes agree
-- on before any runs it.
--
-- Leases a run of the queue's head for many claim slots at once (one array element per slot), of the
-- types whose anchored regexes are given (NULL: any) and the organizations named (NULL: any): rows come
-- locked in queue order, number n pairs each with its slot, the attempt rows go in. Each picked row takes
-- its slot's values by array subscript, never by a join to an unnest() of the slots, which the planner
-- runs as a nested loop re-reading the arrays per row (quadratic in the slots of one grouped claim).
-- With organizations named (a remote worker's claim), each one's head is read from its own queue index,
-- tasks_organization_queue, and the first rows of them all are kept: on tasks_queue, a claim for an
-- organization with few queued tasks would read the whole queue. Rows an organization's head locked
-- beyond those kept stay locked until the claim's transaction ends (other claims skip them meanwhile).
-- Sorting is off in here: the queue index gives the order, and the row estimates for these filters are
-- often far too low (a burst of submits after an ANALYZE of an idle queue), on which the planner would
-- sort the whole queue for every claim. jit is off: the penalty costs of a disabled sort would otherwise
-- trigger compilation. search_path is the schema it is created in.
CREATE OR REPLACE FUNCTION claim(
    p_now double precision, p_limit integer, p_attempt_ids text[], p_tokens text[], p_node_ids text[],
    p_instance_ids text[], p_worker_ids text[], p_nows double precision[], p_expires double precision[],
    p_type_patterns text[], p_tag_sets jsonb, p_organizations text[])
RETURNS TABLE (
    slot bigint, id text, type text, payload text, priority bigint, state text, phase text, progress text,
    attempt integer, max_attempts integer, interruptions integer, timeout_s double precision,
    required_tags text[], idempotency_key text, node_id text, error text, created_at double precision,
    updated_at double precision, available_at double precision, finished_at double precision, organization text,
    inputs text)
LANGUAGE plpgsql
SET enable_sort = off
SET jit = off
SET search_path FROM CURRENT
AS $claim$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH picked AS (
        SELECT a.id, a.priority, a.created_at FROM (
            SELECT t.id, t.priority, t.created_at FROM tasks t
            WHERE p_organizations IS NULL
              AND t.state IN ('pending', 'retry_wait') AND t.available_at <= p_now
              AND t.attempt < t.max_attempts
              AND (p_type_patterns IS NULL OR t.type ~ ANY(p_type_patterns))
              AND (cardinality(t.required_tags) = 0 OR EXISTS (
                  SELECT 1 FROM jsonb_array_elements(p_tag_sets) AS ts(tags)
                  WHERE t.required_tags <@ ARRAY(SELECT jsonb_array_elements_text(ts.tags))))
            ORDER BY t.priority DESC, t.created_at, t.id LIMIT p_limit
            FOR NO KEY UPDATE OF t SKIP LOCKED) a
        UNION ALL
        (SELECT o.id, o.priority, o.created_at FROM unnest(p_organizations) AS org(name) CROSS JOIN LATERAL (
            SELECT t.id, t.priority, t.created_at FROM tasks t
            WHERE t.organization = org.name
              AND t.state IN ('pending', 'retry_wait') AND t.available_at <= p_now
              AND t.attempt < t.max_attempts
              AND (p_type_patterns IS NULL OR t.type ~ ANY(p_type_patterns))
              AND (cardinality(t.required_tags) = 0 OR EXISTS (
                  SELECT 1 FROM jsonb_array_elements(p_tag_sets) AS ts(tags)
                  WHERE t.required_tags <@ ARRAY(SELECT jsonb_array_elements_text(ts.tags))))
            ORDER BY t.priority DESC, t.created_at, t.id LIMIT p_limit
            FOR NO KEY UPDATE OF t SKIP LOCKED) o
         ORDER BY o.priority DESC, o.created_at, o.id LIMIT p_limit)
    ), numbered AS (
        SELECT p.id, row_number() OVER (ORDER BY p.priority DESC, p.created_at, p.id)::integer AS n FROM picked p
    ), leased AS (
        UPDATE tasks t SET state = 'leased', attempt = t.attempt + 1, attempt_rows = t.attempt_rows + 1,
            node_id = p_node_ids[p.n], phase = NULL, progress = NULL, error = NULL, updated_at = p_nows[p.n],
            lease_attempt_id = p_attempt_ids[p.n], lease_token = p_tokens[p.n], lease_expires_at = p_expires[p.n],
            lease_instance = p_instance_ids[p.n]
        FROM numbered p WHERE t.id = p.id
        RETURNING p.n, p_worker_ids[p.n] AS worker_id, t.attempt_rows, t.lease_attempt_id, t.lease_instance, t.id,
            t.type, t.payload, t.priority, t.state, t.phase, t.progress, t.attempt, t.max_attempts,
            t.interruptions, t.timeout_s, t.required_tags, t.idempotency_key, t.node_id, t.error,
            t.created_at, t.updated_at, t.available_at, t.finished_at, t.organization, t.inputs
    ), started AS (
        INSERT INTO attempts (id, task_id, number, node_id, instance_id, worker_id, status, started_at)
        SELECT l.lease_attempt_id, l.id, l.attempt_rows, l.node_id, l.lease_instance, l.worker_id, 'leased',
            l.updated_at
        FROM leased l
    )
    SELECT l.n::bigint, l.id, l.type, l.payload, l.priority, l.state, l.phase, l.progress, l.attempt,
        l.max_attempts, l.interruptions, l.timeout_s, l.required_tags, l.idempotency_key, l.node_id, l.error,
        l.created_at, l.updated_at, l.available_at, l.finished_at, l.organization, l.inputs
    FROM leased l ORDER BY l.n;
END
$claim$;

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
-- never past the attempt's run deadline (least() skips a NULL: no deadline yet)
UPDATE tasks t SET lease_expires_at = least($5, (SELECT a.deadline_at FROM attempts a WHERE a.id = t.lease_attempt_id))
FROM locked WHERE t.id = locked.id
RETURNING t.lease_attempt_id

-- name: set_phase
-- An attempt's first note starts it; the first that carries a deadline ($7: seconds from now) fixes it.
WITH l AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $7::float8[])
        AS l(id, attempt_id, token, phase, progress, deadline_s)
), locked AS MATERIALIZED (
    SELECT t.id, l.phase, l.progress, l.deadline_s FROM tasks t
    JOIN l ON t.id = l.id AND t.lease_attempt_id = l.attempt_id AND t.lease_token = l.token
    WHERE (t.state || '') IN {working} AND t.lease_expires_at > $6
    ORDER BY t.id FOR NO KEY UPDATE OF t
), noted AS (
    UPDATE tasks t SET phase = locked.phase, progress = coalesce(locked.progress, t.progress),
        updated_at = $6, state = 'running'
    FROM locked WHERE t.id = locked.id RETURNING t.lease_attempt_id, locked.deadline_s
), started AS (
    UPDATE attempts a SET status = 'running', deadline_at = coalesce(a.deadline_at, $6 + noted.deadline_s)
    FROM noted
    WHERE a.id = noted.lease_attempt_id
      AND (a.status = 'leased' OR (a.deadline_at IS NULL AND noted.deadline_s IS NOT NULL))
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

-- name: lost_why
-- Of the leases a multi-row write did not take, those still named by their task: its state (a cancel may
-- have won) and the attempt's run deadline.
SELECT l.attempt_id, t.state, a.deadline_at FROM unnest($1::text[], $2::text[], $3::text[]) AS l(id, attempt_id, token)
JOIN tasks t ON t.id = l.id AND t.lease_attempt_id = l.attempt_id AND t.lease_token = l.token
LEFT JOIN attempts a ON a.id = l.attempt_id

-- name: why_lost
SELECT t.state, a.deadline_at FROM tasks t LEFT JOIN attempts a ON a.id = t.lease_attempt_id
WHERE t.id = $1 AND t.lease_attempt_id = $2 AND t.lease_token = $3

-- name: record_result
-- FOR SHARE holds off an expiry or a cancel until the result is in, or sees theirs first. The attempt's row,
-- locked, counts what it stored: a batch goes in only while the quota ($11 batches, $13 bytes; NULL: none)
-- has room for its $12 bytes, and the count moves with it. A batch refused here for want of room may still be
-- one stored before (sent again): the caller looks its key up before it says the quota is reached.
WITH fenced AS (
    SELECT id FROM tasks WHERE id = $1 AND lease_attempt_id = $2 AND lease_token = $3
      AND state IN {working} AND lease_expires_at > $4
    FOR SHARE
), counted AS MATERIALIZED (
    SELECT a.result_count, a.result_bytes FROM attempts a WHERE a.id = $2 AND EXISTS (SELECT 1 FROM fenced)
    FOR NO KEY UPDATE
), room AS (
    SELECT 1 FROM counted
    WHERE $11::integer IS NULL OR (result_count + 1 <= $11 AND result_bytes + $12::bigint <= $13::bigint)
), stored AS (
    INSERT INTO results (idempotency_key, task_id, attempt_id, plugin, sequence, sha256, final, payload,
                         created_at)
    SELECT $5, id, $2, $6, $7, $8, $9, $10, $4 FROM fenced WHERE EXISTS (SELECT 1 FROM room)
    ON CONFLICT (idempotency_key) DO NOTHING RETURNING 1
), counts AS (
    UPDATE attempts a SET result_count = a.result_count + 1, result_bytes = a.result_bytes + $12::bigint
    WHERE a.id = $2 AND EXISTS (SELECT 1 FROM stored)
)
SELECT (SELECT count(*) FROM fenced), (SELECT count(*) FROM stored), (SELECT count(*) FROM room),
       (SELECT result_count FROM counted), (SELECT result_bytes FROM counted)

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
