-- Tasks, their attempts, and the result batches workers stored.
-- One node writes this file, so the reconciler's passes over a node's leases, the cancels past their
-- deadline and the retries due find their few rows through tasks_leases and tasks_state. PostgreSQL,
-- where every node of a fleet runs those passes, keeps a partial index for each of them as well.
CREATE TABLE tasks (
    id TEXT PRIMARY KEY,
    type TEXT NOT NULL,
    payload TEXT NOT NULL,
    priority INTEGER NOT NULL,
    state TEXT NOT NULL,
    phase TEXT,
    progress TEXT,
    attempt INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    interruptions INTEGER NOT NULL DEFAULT 0,
    timeout_s REAL,
    required_tags TEXT NOT NULL,
    idempotency_key TEXT UNIQUE,
    fingerprint TEXT NOT NULL,
    node_id TEXT,
    error TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    available_at REAL NOT NULL,
    finished_at REAL,
    lease_attempt_id TEXT,
    lease_token TEXT,
    lease_expires_at REAL,
    lease_instance TEXT,
    cancel_requested_at REAL
);
CREATE INDEX tasks_queue ON tasks (priority DESC, created_at, id) WHERE state IN ('pending', 'retry_wait');
CREATE INDEX tasks_leases ON tasks (lease_expires_at) WHERE state IN ('leased', 'running', 'cancelling');
CREATE INDEX tasks_state ON tasks (state, id);
CREATE INDEX tasks_type ON tasks (type, id);
CREATE INDEX tasks_finished ON tasks (finished_at) WHERE finished_at IS NOT NULL;
CREATE TABLE attempts (
    id TEXT PRIMARY KEY,
    task_id TEXT NOT NULL,
    number INTEGER NOT NULL,
    node_id TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    status TEXT NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL,
    error TEXT,
    exit_status INTEGER,
    stderr_tail TEXT
);
CREATE INDEX attempts_task ON attempts (task_id, number);
CREATE TABLE results (
    idempotency_key TEXT PRIMARY KEY,
    task_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    plugin TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    final INTEGER NOT NULL,
    payload TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX results_task ON results (task_id, created_at);
