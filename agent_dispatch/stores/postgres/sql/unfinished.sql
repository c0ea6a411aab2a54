-- The unfinished count's statements (schema: v2.sql; written once per transaction since v3.sql):
-- the bounded submit and the bounded dead-letter retry. Loaded by
-- agent_dispatch.stores.postgres._base (admit_unfinished).

-- name: lock_unfinished
-- Taken last in a bounded submit's or retry's transaction (after its inserts or update and the
-- caller's step), so it is held only until the commit and is never waited for while holding the
-- counter.
SELECT n FROM agent_dispatch_unfinished FOR UPDATE

-- name: unfinished
SELECT n FROM agent_dispatch_unfinished
