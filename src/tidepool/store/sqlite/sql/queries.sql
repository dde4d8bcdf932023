-- Every statement the SQLite store runs, by name (loaded once by store/sql.py).
-- A worker's write is fenced by its lease: `id = ? AND lease_attempt_id = ? AND lease_token = ?`.
-- `{marks}` and `{rows}` are filled per call: as many `?` (or row tuples) as the call has items.

-- producers

-- name: count_queued
SELECT count(*) FROM tasks WHERE state IN {queued}

-- name: task_by_key
SELECT {task_columns}, fingerprint FROM tasks WHERE idempotency_key = ?

-- name: tasks_by_keys
SELECT idempotency_key, id, fingerprint FROM tasks WHERE idempotency_key IN ({marks})

-- name: key_used
SELECT 1 FROM tasks WHERE idempotency_key = ?

-- name: insert_task
INSERT INTO tasks (id, type, payload, priority, state, max_attempts, timeout_s, required_tags, idempotency_key,
                   fingerprint, created_at, updated_at, available_at, organization)
VALUES (?, ?, ?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?, ?)

-- name: task_state
SELECT state, type, scan_id, scan_index FROM tasks WHERE id = ?

-- name: cancel_queued
UPDATE tasks SET state = ?, phase = NULL, error = ?, finished_at = ?, updated_at = ? WHERE id = ?

-- name: cancel_held
UPDATE tasks SET state = ?, cancel_requested_at = ?, updated_at = ? WHERE id = ?

-- name: retry
-- A new budget: attempt counts from zero again; attempts[].number keeps counting every row.
UPDATE tasks SET state = ?, attempt = 0, interruptions = 0, available_at = ?, updated_at = ?, finished_at = NULL,
                 error = NULL, progress = NULL
WHERE id = ?

-- readers

-- name: task
SELECT {task_columns} FROM tasks WHERE id = ?

-- name: results_of_task
SELECT {result_columns} FROM results WHERE task_id = ? ORDER BY created_at, sequence

-- name: attempts_of_tasks
SELECT {attempt_columns} FROM attempts WHERE task_id IN ({marks}) ORDER BY task_id, number

-- name: list_tasks
-- `{where}`: the filters given, joined by AND.
SELECT {task_columns} FROM tasks WHERE {where} ORDER BY id DESC LIMIT ?

-- name: counts
SELECT state, count(*) FROM tasks WHERE state IN {unfinished} GROUP BY state

-- name: organization_counts
SELECT organization, count(*) FROM tasks WHERE state IN {unfinished} GROUP BY organization

-- workers

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
UPDATE tasks SET lease_expires_at = ?
WHERE id = ? AND lease_attempt_id = ? AND lease_token = ? AND state IN {working} AND lease_expires_at > ?

-- name: fenced_state
SELECT state FROM tasks WHERE id = ? AND lease_attempt_id = ? AND lease_token = ?

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

-- schedules

-- name: schedule
SELECT {schedule_columns} FROM schedules WHERE name = ?

-- name: schedules
SELECT {schedule_columns} FROM schedules ORDER BY name

-- name: due_schedules
SELECT {schedule_columns} FROM schedules WHERE paused = 0 AND next_run_at <= ?

-- name: save_schedule
INSERT OR REPLACE INTO schedules ({schedule_columns}) VALUES (?, ?, ?, ?, ?, ?, ?)

-- name: delete_schedule
-- With a config node given, only while that node's config still defines the schedule.
DELETE FROM schedules WHERE name = ? AND (? IS NULL OR json_extract(spec, '$.config_node') = ?)

-- the reconciler

-- name: expiring
SELECT state, attempt, max_attempts, interruptions, lease_expires_at, id, lease_attempt_id, lease_token, type,
       scan_id, scan_index
FROM tasks WHERE state IN {active} AND lease_expires_at <= ?

-- name: expiring_of_node
-- Every lease of a node's other processes: the ones that ran before this one.
SELECT state, attempt, max_attempts, interruptions, lease_expires_at, id, lease_attempt_id, lease_token, type,
       scan_id, scan_index
FROM tasks WHERE state IN {active} AND node_id = ? AND lease_instance IS NOT ?

-- name: promote_due
UPDATE tasks SET state = 'pending', updated_at = ? WHERE state = 'retry_wait' AND available_at <= ?

-- name: cancels_due
SELECT id, lease_attempt_id, type, scan_id, scan_index FROM tasks WHERE state = 'cancelling' AND cancel_requested_at <= ?

-- name: cancel_attempt
UPDATE attempts SET status = 'cancelled', finished_at = ?, error = ? WHERE id = ?

-- name: cancel_task
UPDATE tasks SET state = ?, phase = NULL, error = ?, finished_at = ?, updated_at = ?, lease_token = NULL
WHERE id = ?

-- name: prune_results
DELETE FROM results WHERE task_id IN (SELECT id FROM tasks WHERE finished_at < ? AND state IN {terminal})

-- name: prune_attempts
DELETE FROM attempts WHERE task_id IN (SELECT id FROM tasks WHERE finished_at < ? AND state IN {terminal})

-- name: prune_nodes
DELETE FROM nodes WHERE heartbeat_at < ?

-- name: prune_tasks
DELETE FROM tasks WHERE id IN (SELECT id FROM tasks WHERE finished_at < ? AND state IN {terminal})

-- name: queued_tag_sets
SELECT DISTINCT required_tags FROM tasks WHERE state IN {queued} AND required_tags != '[]'

-- name: fail_unserviceable
-- required_tags is stored as a sorted JSON list, so equal sets are equal texts.
UPDATE tasks SET state = ?, phase = NULL, error = ?, finished_at = ?, updated_at = ?
WHERE state IN {queued} AND required_tags = ? RETURNING id, type, scan_id, scan_index

-- the fleet

-- name: node
SELECT {node_columns} FROM nodes WHERE node_id = ?

-- name: nodes
SELECT {node_columns} FROM nodes ORDER BY node_id

-- name: save_node
INSERT OR REPLACE INTO nodes ({node_columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)

-- the worker registry

-- name: worker
SELECT {worker_columns} FROM workers WHERE id = ?

-- name: workers
SELECT {worker_columns} FROM workers ORDER BY id

-- name: save_worker
INSERT OR REPLACE INTO workers ({worker_columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)

-- name: live
SELECT count(*) FROM tasks WHERE node_id = ? AND state IN {active}

-- name: lives
SELECT node_id, count(*) FROM tasks WHERE state IN {active} AND node_id IN (SELECT id FROM workers) GROUP BY node_id

-- name: held_by
-- A worker's active tasks (the caller leaves the cancelling ones be); `{organizations}` narrows them.
SELECT id, lease_attempt_id, type, state FROM tasks
WHERE node_id = ? AND state IN {active} {organizations}

-- name: attempt_owners
SELECT id, node_id FROM attempts WHERE id IN ({marks})
