-- The web UI's reads and its operator action on PostgreSQL (agent_dispatch.stores.postgres._inspect),
-- str.format templates with the fields {now}, {item}, {return_item}, {outcome_cols} and {event}.
-- Each read is bounded by an index or a LIMIT; none scans the whole table.

-- name: browse
SELECT {item} FROM agent_dispatch_work_items WHERE {where} ORDER BY seq DESC LIMIT %(limit)s

-- name: browse_after
seq < (SELECT seq FROM agent_dispatch_work_items WHERE id = %(after)s AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s))

-- name: dependents
SELECT dependent FROM agent_dispatch_dependencies WHERE dependency = %(id)s ORDER BY dependent

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

-- name: depends_on
-- A dead-lettered item's dependencies (no row: absent, another tenant's, or not dead-lettered).
SELECT depends_on FROM agent_dispatch_work_items
WHERE id = %(id)s AND state = 'dead_letter' AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)

-- name: retry_dead_letter_deps
-- Locked in id order (as a submit locks them) and read as committed: a dependency committing now
-- either finishes first (and is seen succeeded) or waits for this retry, whose item its release
-- then finds waiting.
SELECT id, state FROM agent_dispatch_work_items WHERE id = ANY(%(deps)s) ORDER BY id FOR SHARE

-- name: retry_dead_letter
-- Back to waiting (submitted) while a dependency has not succeeded yet, else ready. Epoch and
-- token are kept: the next claim issues new ones, so a stale lease stays fenced.
WITH upd AS (
    UPDATE agent_dispatch_work_items SET state = CASE WHEN %(pending)s > 0 THEN 'submitted' ELSE 'ready' END,
        pending_deps = %(pending)s, max_attempts = greatest(max_attempts, attempt + 1),
        lease_owner = NULL, lease_expires_at = NULL, not_before = NULL, outcome = NULL, error = NULL,
        commit_token = NULL, last_dispatched_at = NULL, updated_at = {now}
    WHERE id = %(id)s AND state = 'dead_letter' AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
    RETURNING {return_item}
), ev AS ({event})
SELECT * FROM upd

-- name: tenant_names
-- Tenant names in order after %(after)s, one index descent each (a skip scan of the counters'
-- tenant index): the cost is the page's size, whatever the number of items or tenants.
WITH RECURSIVE t(tenant) AS (
    (SELECT tenant FROM agent_dispatch_tenant_counts WHERE tenant > %(after)s ORDER BY tenant LIMIT 1)
    UNION ALL
    SELECT (SELECT c.tenant FROM agent_dispatch_tenant_counts c WHERE c.tenant > t.tenant ORDER BY c.tenant LIMIT 1)
      FROM t WHERE t.tenant IS NOT NULL
)
SELECT tenant FROM t WHERE tenant IS NOT NULL LIMIT %(limit)s

-- name: tenant_stats
-- The named tenants' counters (their folded row plus any deltas since) and each one's oldest
-- waiting item, the first entry of its part of the waiting index.
SELECT c.tenant, c.queued, c.running, c.done, c.served_at, w.created_at AS oldest
  FROM (SELECT tenant, sum(queued) AS queued, sum(running) AS running, sum(done) AS done,
               max(served_at) AS served_at
          FROM agent_dispatch_tenant_counts WHERE tenant = ANY(%(tenants)s) GROUP BY tenant) c
  LEFT JOIN LATERAL (
        SELECT created_at FROM agent_dispatch_work_items i
         WHERE i.tenant = c.tenant AND i.state IN ('submitted', 'ready')
         ORDER BY i.seq LIMIT 1) w ON true
 ORDER BY c.tenant

-- name: tenant_fold
SELECT agent_dispatch_tenant_fold(%(limit)s) AS folded
