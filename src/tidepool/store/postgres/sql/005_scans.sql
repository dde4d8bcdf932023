-- Version 5: scans, a profile's steps run as one task each. A step's task names its scan, job and retry
-- number, so the transaction that ends it finds its scan; a job's tasks are unique by the three.
ALTER TABLE tasks ADD COLUMN scan_id text;
ALTER TABLE tasks ADD COLUMN scan_index integer;
ALTER TABLE tasks ADD COLUMN scan_retry integer;
CREATE UNIQUE INDEX tasks_scan_job ON tasks (scan_id, scan_index, scan_retry) WHERE scan_id IS NOT NULL;
CREATE TABLE scans (
    id text PRIMARY KEY,
    profile text NOT NULL,
    state text NOT NULL CHECK (state IN ('running', 'succeeded', 'failed', 'cancelled')),
    organization text NOT NULL,
    payload text NOT NULL,
    scope text NOT NULL,
    priority bigint NOT NULL,
    continue_on_failure boolean NOT NULL,
    idempotency_key text UNIQUE,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    finished_at double precision,
    cancel_requested_at double precision,
    fingerprint text NOT NULL
);
CREATE INDEX scans_state ON scans (state, id);
CREATE INDEX scans_profile ON scans (profile, id);
CREATE INDEX scans_finished ON scans (finished_at) WHERE finished_at IS NOT NULL;
-- One row per step of a scan: its step (type and task defaults, JSON), its state as stored (waiting,
-- started, an end, skipped), its latest task, how many tasks it has had, and the scope before it.
CREATE TABLE scan_jobs (
    scan_id text NOT NULL,
    idx integer NOT NULL,
    step text NOT NULL,
    state text NOT NULL,
    task_id text,
    tasks integer NOT NULL DEFAULT 0,
    scope_before text NOT NULL DEFAULT '{}',
    PRIMARY KEY (scan_id, idx)
);
