-- Scans: a profile's steps run as one task each. A step's task names its scan, job and retry number, so
-- the transaction that ends it finds its scan; a job's tasks are unique by the three.
ALTER TABLE tasks ADD COLUMN scan_id TEXT;
ALTER TABLE tasks ADD COLUMN scan_index INTEGER;
ALTER TABLE tasks ADD COLUMN scan_retry INTEGER;
CREATE UNIQUE INDEX tasks_scan_job ON tasks (scan_id, scan_index, scan_retry) WHERE scan_id IS NOT NULL;
CREATE TABLE scans (
    id TEXT PRIMARY KEY,
    profile TEXT NOT NULL,
    state TEXT NOT NULL,
    organization TEXT NOT NULL,
    payload TEXT NOT NULL,
    scope TEXT NOT NULL,
    priority INTEGER NOT NULL,
    continue_on_failure INTEGER NOT NULL,
    idempotency_key TEXT UNIQUE,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    finished_at REAL,
    cancel_requested_at REAL,
    fingerprint TEXT NOT NULL
);
CREATE INDEX scans_state ON scans (state, id);
CREATE INDEX scans_profile ON scans (profile, id);
CREATE INDEX scans_finished ON scans (finished_at) WHERE finished_at IS NOT NULL;
-- One row per step of a scan: its step (type and task defaults, JSON), its state as stored (waiting,
-- started, an end, skipped), its latest task, how many tasks it has had, and the scope before it.
CREATE TABLE scan_jobs (
    scan_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    step TEXT NOT NULL,
    state TEXT NOT NULL,
    task_id TEXT,
    tasks INTEGER NOT NULL DEFAULT 0,
    scope_before TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (scan_id, idx)
);
