-- The web UI's reads and its operator action on PostgreSQL (agent_dispatch.stores.postgres._inspect),
-- str.format templates with the fields {now}, {item}, {return_item}, {outcome_cols} and {event}.
-- Each read is bounded by an index or a LIMIT; none scans the whole table.

-- name: browse
SELECT {item} FROM agent_dispatch_work_items WHERE {where} ORDER BY seq DESC LIMIT %(limit)s

-- name: browse_after
seq < (SELECT seq FROM agent_dispatch_work_items WHERE id = %(after)s AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s))

-- name: dependents
SELECT dependent FROM agent_dispatch_dependencies WHERE dependency = %(id)s ORDER BY dependent

-- name: backlog
-- Unfinished rows only: the claim indexes hold ready/leased/running, so finished history is never read.
SELECT tenant,
       count(*) FILTER (WHERE state IN ('submitted', 'ready')) AS queued,
       count(*) FILTER (WHERE state IN ('leased', 'running')) AS running,
       min(created_at) FILTER (WHERE state IN ('submitted', 'ready')) AS oldest
FROM agent_dispatch_work_items
WHERE state IN ('submitted', 'ready', 'leased', 'running')
GROUP BY tenant ORDER BY queued DESC, tenant LIMIT %(limit)s

-- name: held
-- The lease-expiry partial index, read from its head.
SELECT {item} FROM agent_dispatch_work_items WHERE state IN ('leased', 'running')
ORDER BY lease_expires_at LIMIT %(limit)s

-- name: events_after
-- Identity values can commit out of order under concurrent writers, so a reader that has passed
-- a seq may see an earlier one appear later: the UI's rates are a sample, not an audit.
SELECT seq, {outcome_cols} FROM agent_dispatch_outcomes WHERE seq > %(seq)s ORDER BY seq LIMIT %(limit)s

-- name: newest_event
SELECT seq, {outcome_cols} FROM agent_dispatch_outcomes ORDER BY seq DESC LIMIT 1

-- name: retry_dead_letter
-- Epoch and token are kept: the next claim issues new ones, so a stale lease stays fenced.
WITH upd AS (
    UPDATE agent_dispatch_work_items SET state = 'ready', max_attempts = greatest(max_attempts, attempt + 1),
        lease_owner = NULL, lease_expires_at = NULL, not_before = NULL, outcome = NULL, error = NULL,
        commit_token = NULL, last_dispatched_at = NULL, updated_at = {now}
    WHERE id = %(id)s AND state = 'dead_letter' AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
    RETURNING {return_item}
), ev AS ({event})
SELECT * FROM upd
