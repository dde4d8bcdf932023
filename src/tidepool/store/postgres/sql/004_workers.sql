-- Version 4: the remote workers a gateway serves, one row per certificate identity, and the organization of
-- each task (which remote workers may see it). An acquire locks its worker's row, so the gateways sharing
-- the store take turns per worker and its cap holds; it counts the worker's live attempts by
-- tasks_node_leases, and its claim reads each of its organizations' queued tasks in queue order by
-- tasks_organization_queue. The claim function takes the organizations now: its older form goes, and claim.sql
-- defines the new one after the migrations.
ALTER TABLE tasks ADD COLUMN organization text NOT NULL DEFAULT 'default';
CREATE INDEX tasks_organization ON tasks (organization, id);
CREATE INDEX tasks_organization_queue ON tasks (organization, priority DESC, created_at, id)
    WHERE state IN ('pending', 'retry_wait');
CREATE TABLE workers (
    id text PRIMARY KEY,
    state text NOT NULL CHECK (state IN ('pending', 'enabled', 'disabled', 'revoked')),
    max_concurrent_tasks integer NOT NULL,
    task_types text[] NOT NULL,
    organizations text[] NOT NULL,
    slots text NOT NULL,                -- JSON: the tag set of each slot it last reported
    version text,
    fingerprints text NOT NULL,         -- JSON: [{fingerprint, not_after}, ...], oldest first
    first_seen double precision NOT NULL,
    last_seen double precision NOT NULL,
    address text
);
DROP FUNCTION IF EXISTS claim(double precision, integer, text[], text[], text[], text[], text[], double precision[],
                              double precision[], text[], jsonb);
