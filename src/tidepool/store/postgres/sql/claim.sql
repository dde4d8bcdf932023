-- The claim function, (re)defined after the numbered migrations whenever a schema is migrated, so
-- its one definition is this file: a change to it comes with a new schema version, which a fleet's
-- nodes agree on before any runs it.
--
-- Leases a run of the queue's head for many claim slots at once (one array element per slot), of the
-- types whose anchored regexes are given (NULL: any) and the organizations named (NULL: any):
-- rows come locked in queue order, number n pairs each with its slot, the attempt rows go in.
-- Each picked row takes its slot's values by array subscript. (Version 1 joined the rows to an
-- unnest() of the slots, which the planner, sorting off and tiny estimates, ran as a nested loop
-- re-reading the arrays per row: quadratic in the slots of one grouped claim.)
-- With organizations named (a remote worker's claim), each one's head is read from its own queue index,
-- tasks_organization_queue, and the first rows of them all are kept: on tasks_queue, a claim for an
-- organization with few queued tasks read the whole queue. Rows an organization's head locked beyond
-- those kept stay locked until the claim's transaction ends (other claims skip them meanwhile).
-- Sorting is off in here: the queue index gives the order, and the row estimates for these
-- filters are often far too low (a burst of submits after an ANALYZE of an idle queue), on which
-- the planner would sort the whole queue for every claim. jit is off: the penalty costs of a
-- disabled sort would otherwise trigger compilation. search_path is the schema it is created in.
CREATE OR REPLACE FUNCTION claim(
    p_now double precision, p_limit integer, p_attempt_ids text[], p_tokens text[], p_node_ids text[],
    p_instance_ids text[], p_worker_ids text[], p_nows double precision[], p_expires double precision[],
    p_type_patterns text[], p_tag_sets jsonb, p_organizations text[])
RETURNS TABLE (
    slot bigint, id text, type text, payload text, priority bigint, state text, phase text, progress text,
    attempt integer, max_attempts integer, interruptions integer, timeout_s double precision,
    required_tags text[], idempotency_key text, node_id text, error text, created_at double precision,
    updated_at double precision, available_at double precision, finished_at double precision, organization text)
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
            t.created_at, t.updated_at, t.available_at, t.finished_at, t.organization
    ), started AS (
        INSERT INTO attempts (id, task_id, number, node_id, instance_id, worker_id, status, started_at)
        SELECT l.lease_attempt_id, l.id, l.attempt_rows, l.node_id, l.lease_instance, l.worker_id, 'leased',
            l.updated_at
        FROM leased l
    )
    SELECT l.n::bigint, l.id, l.type, l.payload, l.priority, l.state, l.phase, l.progress, l.attempt,
        l.max_attempts, l.interruptions, l.timeout_s, l.required_tags, l.idempotency_key, l.node_id, l.error,
        l.created_at, l.updated_at, l.available_at, l.finished_at, l.organization
    FROM leased l ORDER BY l.n;
END
$claim$;
