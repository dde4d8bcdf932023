-- Files in and out of tasks. A blob's record (its bytes are files beside the database); the inputs a task
-- was submitted with, as JSON on its row for every read and as rows naming their blobs, which the pruning
-- of blobs reads; a scan's inputs likewise; and the artifacts each attempt recorded, one per name.
ALTER TABLE tasks ADD COLUMN inputs TEXT NOT NULL DEFAULT '{}';
CREATE TABLE blobs (
    sha256 TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX blobs_created ON blobs (created_at);
CREATE TABLE task_inputs (
    task_id TEXT NOT NULL,
    name TEXT NOT NULL,
    sha256 TEXT NOT NULL REFERENCES blobs (sha256),
    PRIMARY KEY (task_id, name)
);
CREATE INDEX task_inputs_blob ON task_inputs (sha256);
CREATE TABLE scan_inputs (
    scan_id TEXT NOT NULL,
    name TEXT NOT NULL,
    sha256 TEXT NOT NULL REFERENCES blobs (sha256),
    PRIMARY KEY (scan_id, name)
);
CREATE INDEX scan_inputs_blob ON scan_inputs (sha256);
CREATE TABLE artifacts (
    attempt_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    name TEXT NOT NULL,
    sha256 TEXT NOT NULL REFERENCES blobs (sha256),
    size INTEGER NOT NULL,
    content_type TEXT,
    created_at REAL NOT NULL,
    PRIMARY KEY (attempt_id, name)
);
CREATE INDEX artifacts_task ON artifacts (task_id, created_at);
CREATE INDEX artifacts_blob ON artifacts (sha256);
