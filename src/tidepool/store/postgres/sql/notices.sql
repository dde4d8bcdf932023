-- The notices the gateways sharing the store hear from each other (notices.py), on the schema's NOTIFY
-- channel beside the wake-ups; each is delivered at its transaction's commit, in the order sent.

-- name: notify_all
SELECT pg_notify(current_setting('tidepool.channel'), p) FROM unnest($1::text[]) AS p

-- name: notify_remote_cancel
-- A cancel of a task a remote worker ($3: the instance of its attempts) holds: "$2 cancel attempt worker".
SELECT pg_notify(current_setting('tidepool.channel'), $2 || ' cancel ' || lease_attempt_id || ' ' || node_id)
FROM tasks WHERE id = $1 AND lease_instance = $3 AND lease_attempt_id IS NOT NULL AND node_id IS NOT NULL
