-- The SQLite store's statements of a worker's leases (leases.py), by name: claims, renewals, phase notes,
-- results, endings. A worker's write is fenced by its lease: `id = ? AND lease_attempt_id = ? AND lease_token = ?`.
-- `{marks}` and `{rows}` are filled per call: as many `?` (or `*_row` tuples) as the call has items.

-- name: claimable
-- `{types}`: `AND type IN (?, ...)`, the names claimed, unless any type will do, then the type globs of a
-- remote worker's acquire; `{tags}`: one clause per free slot's tag set.
SELECT {task_columns} FROM tasks INDEXED BY tasks_queue
WHERE state IN {queued} AND available_at <= ? AND attempt < max_attempts {types} AND (required_tags = '[]' {tags})
ORDER BY priority DESC, created_at, id LIMIT ?

-- name: claimable_of_organization
-- One organization's share of a remote worker's claim, read in queue order from that organization's own
-- queue index (on tasks_queue, a claim for an organization with few queued tasks would read the whole queue);
-- claimable joins one per organization with UNION ALL and keeps the first rows of them all.
SELECT * FROM (SELECT {task_columns} FROM tasks INDEXED BY tasks_organization_queue
WHERE organization = ? AND state IN {queued} AND available_at <= ? AND attempt < max_attempts {types}
  AND (required_tags = '[]' {tags})
ORDER BY priority DESC, created_at, id LIMIT ?)

-- name: claimable_tags
OR NOT EXISTS (SELECT 1 FROM json_each(required_tags) WHERE value NOT IN ({marks}))

-- name: lease
UPDATE tasks SET state = 'leased', attempt = attempt + 1, node_id = v.column2, phase = NULL, progress = NULL,
                 error = NULL, updated_at = v.column3, lease_attempt_id = v.column4, lease_token = v.column5,
                 lease_expires_at = v.column6, lease_instance = v.column7
FROM (VALUES {rows}) AS v WHERE tasks.id = v.column1

-- name: lease_row
(?, ?, ?, ?, ?, ?, ?)

-- name: open_attempts
INSERT INTO attempts (id, task_id, number, node_id, instance_id, worker_id, status, started_at) VALUES {rows}

-- name: open_attempts_row
(?, ?, (SELECT count(*) + 1 FROM attempts WHERE task_id = ?), ?, ?, ?, 'leased', ?)

-- name: renew
-- Never past the attempt's run deadline: a lease that ran to it is over, and every fenced write finds it so.
UPDATE tasks SET lease_expires_at = min(?1, coalesce((SELECT deadline_at FROM attempts WHERE id = ?3), ?1))
WHERE id = ?2 AND lease_attempt_id = ?3 AND lease_token = ?4 AND state IN {working} AND lease_expires_at > ?5

-- name: fenced_state
SELECT t.state, a.deadline_at FROM tasks t LEFT JOIN attempts a ON a.id = t.lease_attempt_id
WHERE t.id = ? AND t.lease_attempt_id = ? AND t.lease_token = ?

-- name: start_deadline
-- The first note of an attempt's run phase fixes its deadline; a later one changes nothing.
UPDATE attempts SET deadline_at = ? WHERE id = ? AND deadline_at IS NULL

-- name: result_counts
SELECT result_count, result_bytes FROM attempts WHERE id = ?

-- name: count_result
UPDATE attempts SET result_count = result_count + 1, result_bytes = result_bytes + ? WHERE id = ?

-- name: note_phases
-- `+tasks.state` keeps the planner on the primary key rather than the state index.
UPDATE tasks SET phase = v.column4, progress = coalesce(v.column5, progress), updated_at = ?, state = 'running'
FROM (VALUES {rows}) AS v
WHERE tasks.id = v.column1 AND tasks.lease_attempt_id = v.column2 AND tasks.lease_token = v.column3
  AND +tasks.state IN {working} AND tasks.lease_expires_at > ?

-- name: note_phases_row
(?, ?, ?, ?, ?)

-- name: noted
SELECT 1 FROM tasks
WHERE id = ? AND lease_attempt_id = ? AND lease_token = ? AND state = 'running' AND lease_expires_at > ?

-- name: start_attempts
UPDATE attempts SET status = 'running' WHERE status = 'leased' AND id IN ({marks})

-- name: live_state
SELECT state FROM tasks WHERE id = ? AND lease_attempt_id = ? AND lease_token = ? AND lease_expires_at > ?

-- name: result_by_key
SELECT {result_columns} FROM results WHERE idempotency_key = ?

-- name: insert_result
INSERT INTO results (idempotency_key, task_id, attempt_id, plugin, sequence, sha256, final, payload, created_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)

-- name: complete
-- The join picks the rows by primary key; `+state` keeps the planner off the state index. No RETURNING:
-- each returned row is a step that gives the GIL away, and nearly always all succeed.
UPDATE tasks SET state = 'completed', phase = NULL, progress = coalesce(v.column5, progress), error = NULL,
                 updated_at = v.column4, finished_at = v.column4, lease_token = NULL
FROM (VALUES {rows}) AS v
WHERE tasks.id = v.column1 AND tasks.lease_attempt_id = v.column2 AND tasks.lease_token = v.column3
  AND +tasks.state IN {working} AND tasks.lease_expires_at > v.column4
  AND tasks.scan_id IS NULL  -- a scan step's success moves its scan too: the one-by-one path

-- name: complete_row
(?, ?, ?, ?, ?)

-- name: completed_now
-- Of these attempts, the ones `complete` just ended: their task is completed and they are still open.
SELECT a.id FROM attempts a JOIN tasks t ON t.id = a.task_id
WHERE a.id IN ({marks}) AND a.status IN ('leased', 'running') AND t.lease_attempt_id = a.id
  AND t.state = 'completed'

-- name: attempts_succeeded
UPDATE attempts SET status = 'succeeded', finished_at = v.column2 FROM (VALUES {rows}) AS v
WHERE attempts.id = v.column1

-- name: attempts_succeeded_row
(?, ?)

-- name: ending
SELECT state, attempt, max_attempts, interruptions, lease_expires_at, scan_id, scan_index FROM tasks
WHERE id = ? AND lease_attempt_id = ? AND lease_token = ?

-- name: end_attempt
UPDATE attempts SET status = ?, finished_at = ?, error = ?, exit_status = ?, stderr_tail = ? WHERE id = ?

-- name: end_task
UPDATE tasks SET state = ?, phase = NULL, progress = coalesce(?, progress), error = ?, updated_at = ?,
                 attempt = attempt - ?, interruptions = interruptions + ?, available_at = coalesce(?, available_at),
                 finished_at = ?, lease_token = NULL
WHERE id = ?
