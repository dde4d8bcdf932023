-- Version 1: tasks, their attempts and their results. Run with search_path set to the store's schema.
CREATE TABLE schema_version (version integer PRIMARY KEY, applied_at double precision NOT NULL);
CREATE TABLE tasks (
    id text PRIMARY KEY,
    type text NOT NULL,
    payload text NOT NULL,              -- JSON kept verbatim: jsonb refuses \u0000, SQLite does not
    priority bigint NOT NULL,
    state text NOT NULL CHECK (state IN ('pending', 'leased', 'running', 'retry_wait', 'cancelling',
                                         'completed', 'failed', 'timed_out', 'cancelled')),
    phase text,
    progress text,
    attempt integer NOT NULL DEFAULT 0,
    attempt_rows integer NOT NULL DEFAULT 0,  -- numbers attempts[] under the row lock, never recounted
    max_attempts integer NOT NULL,
    interruptions integer NOT NULL DEFAULT 0,
    timeout_s double precision,
    required_tags text[] NOT NULL DEFAULT '{}',
    idempotency_key text UNIQUE,
    fingerprint text NOT NULL,
    node_id text,
    error text,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    available_at double precision NOT NULL,
    finished_at double precision,
    lease_attempt_id text,
    lease_token text,
    lease_expires_at double precision,
    lease_instance text,
    cancel_requested_at double precision
);
CREATE INDEX tasks_queue ON tasks (priority DESC, created_at, id)
    WHERE state IN ('pending', 'retry_wait');
CREATE INDEX tasks_leases ON tasks (lease_expires_at)
    WHERE state IN ('leased', 'running', 'cancelling');
CREATE INDEX tasks_node_leases ON tasks (node_id) WHERE state IN ('leased', 'running', 'cancelling');
CREATE INDEX tasks_cancelling ON tasks (cancel_requested_at) WHERE state = 'cancelling';
CREATE INDEX tasks_retry_due ON tasks (available_at) WHERE state = 'retry_wait';
CREATE INDEX tasks_state ON tasks (state, id);
CREATE INDEX tasks_type ON tasks (type, id);
CREATE INDEX tasks_finished ON tasks (finished_at) WHERE finished_at IS NOT NULL;
CREATE TABLE attempts (
    id text PRIMARY KEY,
    task_id text NOT NULL,
    number integer NOT NULL,
    node_id text NOT NULL,
    instance_id text NOT NULL,
    worker_id text NOT NULL,
    status text NOT NULL,
    started_at double precision NOT NULL,
    finished_at double precision,
    error text,
    exit_status integer,
    stderr_tail text
);
CREATE INDEX attempts_task ON attempts (task_id, number);
CREATE TABLE results (
    idempotency_key text PRIMARY KEY,
    task_id text NOT NULL,
    attempt_id text NOT NULL,
    plugin text NOT NULL,
    sequence integer NOT NULL,
    sha256 text NOT NULL,
    final boolean NOT NULL,
    payload text NOT NULL,
    created_at double precision NOT NULL
);
CREATE INDEX results_task ON results (task_id, created_at);
