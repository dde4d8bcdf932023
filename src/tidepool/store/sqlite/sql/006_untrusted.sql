-- A gateway that does not trust its workers. A worker's record binds its identity to the CA that issued its
-- first certificate (issuer: that CA certificate's SHA-256, hex) and narrows what it may lease to the
-- operator's tag globs (tags, a JSON list). An attempt's deadline_at, set when its run phase starts, is when
-- the store stops taking its renewals and writes; result_count and result_bytes are what it stored so far,
-- which its quota bounds.
ALTER TABLE workers ADD COLUMN issuer TEXT;
ALTER TABLE workers ADD COLUMN tags TEXT NOT NULL DEFAULT '["*"]';
ALTER TABLE attempts ADD COLUMN deadline_at REAL;
ALTER TABLE attempts ADD COLUMN result_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN result_bytes INTEGER NOT NULL DEFAULT 0;
