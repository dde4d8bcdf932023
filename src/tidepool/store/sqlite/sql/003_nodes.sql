-- The node registry: one row per node id, saved with every heartbeat.
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    instance_id TEXT NOT NULL,
    hostname TEXT NOT NULL,
    pid INTEGER NOT NULL,
    version TEXT NOT NULL,
    started_at REAL NOT NULL,
    heartbeat_at REAL NOT NULL,
    heartbeat_s REAL NOT NULL,
    stopped_at REAL,
    task_types TEXT NOT NULL,
    tags TEXT NOT NULL,
    max_workers INTEGER NOT NULL
);
