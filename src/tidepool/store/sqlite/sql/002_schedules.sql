-- Schedules: each makes a task per tick.
CREATE TABLE IF NOT EXISTS schedules (
    name TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    paused INTEGER NOT NULL DEFAULT 0,
    next_tick_at REAL,
    next_run_at REAL,
    last_run_at REAL,
    last_task_id TEXT
);
CREATE INDEX IF NOT EXISTS schedules_due ON schedules (next_run_at) WHERE paused = 0;
