-- Version 6: a gateway that does not trust its workers. A worker's record binds its identity to the CA that
-- issued its first certificate (issuer: that CA certificate's SHA-256, hex) and narrows what it may lease to
-- the operator's tag globs (tags). An attempt's deadline_at, set when its run phase starts, is when the store
-- stops taking its renewals and writes; result_count and result_bytes are what it stored so far, which its
-- quota bounds. Adding columns with constant defaults rewrites no table.
ALTER TABLE workers ADD COLUMN issuer text;
ALTER TABLE workers ADD COLUMN tags text[] NOT NULL DEFAULT '{*}';
ALTER TABLE attempts ADD COLUMN deadline_at double precision;
ALTER TABLE attempts ADD COLUMN result_count integer NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN result_bytes bigint NOT NULL DEFAULT 0;
