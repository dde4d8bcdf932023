-- Version 7: files in and out of tasks. A blob's record, and its bytes in chunks of at most 1 MiB (with
-- [artifacts] store = "file" they are files of one node instead); the inputs a task was submitted with, as
-- JSON on its row for every read and as rows whose foreign keys hold their blobs against the pruning; a
-- scan's inputs likewise; and the artifacts each attempt recorded, one per name. The claim function
-- returns the tasks' inputs too: it is dropped here and defined again after the migrations.
ALTER TABLE tasks ADD COLUMN inputs text NOT NULL DEFAULT '{}';
CREATE TABLE blobs (
    sha256 text PRIMARY KEY,
    size bigint NOT NULL,
    created_at double precision NOT NULL
);
CREATE INDEX blobs_created ON blobs (created_at);
CREATE TABLE blob_chunks (
    sha256 text NOT NULL,               -- a blob's, or 'partial:<id>' while its upload streams in
    seq integer NOT NULL,
    data bytea NOT NULL,
    PRIMARY KEY (sha256, seq)
);
CREATE TABLE task_inputs (
    task_id text NOT NULL,
    name text NOT NULL,
    sha256 text NOT NULL REFERENCES blobs (sha256),
    PRIMARY KEY (task_id, name)
);
CREATE INDEX task_inputs_blob ON task_inputs (sha256);
CREATE TABLE scan_inputs (
    scan_id text NOT NULL,
    name text NOT NULL,
    sha256 text NOT NULL REFERENCES blobs (sha256),
    PRIMARY KEY (scan_id, name)
);
CREATE INDEX scan_inputs_blob ON scan_inputs (sha256);
CREATE TABLE artifacts (
    attempt_id text NOT NULL,
    task_id text NOT NULL,
    name text NOT NULL,
    sha256 text NOT NULL REFERENCES blobs (sha256),
    size bigint NOT NULL,
    content_type text,
    created_at double precision NOT NULL,
    PRIMARY KEY (attempt_id, name)
);
CREATE INDEX artifacts_task ON artifacts (task_id, created_at);
CREATE INDEX artifacts_blob ON artifacts (sha256);
DROP FUNCTION IF EXISTS claim(double precision, integer, text[], text[], text[], text[], text[], double precision[],
                              double precision[], text[], jsonb, text[]);
