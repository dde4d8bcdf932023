-- Version 2: schedules.
CREATE TABLE schedules (
    name text PRIMARY KEY,
    spec text NOT NULL,                 -- schedules.spec_of(): what defines it, as JSON
    paused boolean NOT NULL DEFAULT false,
    next_tick_at double precision,
    next_run_at double precision,
    last_run_at double precision,
    last_task_id text
);
CREATE INDEX schedules_due ON schedules (next_run_at) WHERE NOT paused;
