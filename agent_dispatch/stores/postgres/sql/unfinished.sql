-- The bounded submit's statements (schema: v2.sql). Loaded by agent_dispatch.stores.postgres._submit.

-- name: lock_unfinished
-- Taken last in a bounded submit's transaction (after the inserts and the caller's step), so it is
-- held only until the commit and is never waited for while holding the counter.
SELECT n FROM agent_dispatch_unfinished FOR UPDATE

-- name: unfinished
SELECT n FROM agent_dispatch_unfinished
