-- The remote workers a gateway serves, one row per certificate identity, and the organization of each task
-- (which remote workers may see it). task_types, organizations, slots and fingerprints are JSON lists.
-- tasks_node_leases finds a worker's live attempts: every acquire counts them against its cap.
-- tasks_organization_queue gives a remote worker's claim each of its organizations' queued tasks in queue order.
ALTER TABLE tasks ADD COLUMN organization TEXT NOT NULL DEFAULT 'default';
CREATE INDEX tasks_organization ON tasks (organization, id);
CREATE INDEX tasks_organization_queue ON tasks (organization, priority DESC, created_at, id)
    WHERE state IN ('pending', 'retry_wait');
CREATE INDEX tasks_node_leases ON tasks (node_id) WHERE state IN ('leased', 'running', 'cancelling');
CREATE TABLE workers (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    max_concurrent_tasks INTEGER NOT NULL,
    task_types TEXT NOT NULL,
    organizations TEXT NOT NULL,
    slots TEXT NOT NULL,
    version TEXT,
    fingerprints TEXT NOT NULL,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    address TEXT
);
