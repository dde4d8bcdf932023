-- The remote workers' statements: the worker registry, and the notices the gateways sharing the store send
-- each other.
--
-- Every write of a worker's record locks its row first (FOR UPDATE), then the tasks it touches: the gateways
-- sharing a store take turns per worker, an acquire counts the worker's live attempts after the last acquire
-- of it committed, and two writes never lock in opposite orders.
--
-- The notices go on the schema's NOTIFY channel beside the wake-ups; each is delivered at its transaction's
-- commit, in the order sent.

-- name: worker
SELECT {worker_columns},
    (SELECT count(*) FROM tasks t WHERE t.node_id = w.id AND t.state IN {active})
FROM workers w WHERE id = $1

-- name: workers
SELECT {worker_columns},
    (SELECT count(*) FROM tasks t WHERE t.node_id = w.id AND t.state IN {active})
FROM workers w ORDER BY id

-- name: lock_worker
-- Only the lock: a statement that waited for it still reads with the snapshot it began with, so the live
-- attempts are counted by the next statement (`worker`), which sees what the last holder committed.
SELECT 1 FROM workers WHERE id = $1 FOR UPDATE

-- name: first_contact
-- Nothing when another gateway recorded this identity first: the caller then locks that row.
INSERT INTO workers ({worker_columns})
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
ON CONFLICT (id) DO NOTHING RETURNING id

-- name: save_worker
UPDATE workers SET state = $2, max_concurrent_tasks = $3, task_types = $4, organizations = $5, slots = $6,
    version = $7, fingerprints = $8, first_seen = $9, last_seen = $10, address = $11, issuer = $12, tags = $13
WHERE id = $1

-- name: is_node
SELECT 1 FROM nodes WHERE node_id = $1

-- name: cancel_held
-- The worker's leased and running tasks (of the organizations not in $4, unless NULL) -> $3 (cancelling), as
-- a cancel moves them.
UPDATE tasks SET state = $3, cancel_requested_at = $2, updated_at = $2
WHERE node_id = $1 AND state IN {working} AND ($4::text[] IS NULL OR organization <> ALL($4::text[]))
RETURNING id, lease_attempt_id, type

-- name: cancelling_of
-- The attempts of a worker that a cancel moved to cancelling: its answers tell it to stop them.
SELECT lease_attempt_id FROM tasks
WHERE node_id = $1 AND state IN {active} AND state = 'cancelling' AND lease_attempt_id IS NOT NULL

-- name: attempt_owners
SELECT id, node_id FROM attempts WHERE id = ANY($1::text[])

-- name: claimable_any
-- Whether the claim function would find a row for these arguments (its WHERE, without its lock): an acquire
-- that finds none and has nothing of the worker's to save answers from this read, without a transaction.
SELECT 1 FROM tasks t
WHERE t.state IN ('pending', 'retry_wait') AND t.available_at <= $1 AND t.attempt < t.max_attempts
  AND ($2::text[] IS NULL OR t.type ~ ANY($2::text[]))
  AND ($4::text[] IS NULL OR t.organization = ANY($4::text[]))
  AND (cardinality(t.required_tags) = 0 OR EXISTS (
      SELECT 1 FROM jsonb_array_elements($3::jsonb) AS ts(tags)
      WHERE t.required_tags <@ ARRAY(SELECT jsonb_array_elements_text(ts.tags))))
LIMIT 1

-- name: notify_all
SELECT pg_notify(current_setting('tidepool.channel'), p) FROM unnest($1::text[]) AS p

-- name: notify_remote_cancel
-- A cancel of a task a remote worker ($3: the instance of its attempts) holds: "$2 cancel attempt worker".
SELECT pg_notify(current_setting('tidepool.channel'), $2 || ' cancel ' || lease_attempt_id || ' ' || node_id)
FROM tasks WHERE id = $1 AND lease_instance = $3 AND lease_attempt_id IS NOT NULL AND node_id IS NOT NULL
