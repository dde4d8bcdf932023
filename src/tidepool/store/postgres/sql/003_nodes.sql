-- Version 3: the node registry every node re-saves with its heartbeat.
CREATE TABLE nodes (
    node_id text PRIMARY KEY,
    instance_id text NOT NULL,
    hostname text NOT NULL,
    pid integer NOT NULL,
    version text NOT NULL,
    started_at double precision NOT NULL,
    heartbeat_at double precision NOT NULL,
    heartbeat_s double precision NOT NULL,
    stopped_at double precision,
    task_types text[] NOT NULL,
    tags text NOT NULL,                 -- JSON: the tag set of each resource
    max_workers integer NOT NULL
);
