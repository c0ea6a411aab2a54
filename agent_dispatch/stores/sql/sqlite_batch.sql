-- The SQLite store's batch calls (agent_dispatch.stores._sqlite_batch): a worker's batch in a few
-- statements instead of a load, a check and a write per item. They run inside the store's
-- BEGIN IMMEDIATE transaction, which holds the file's only write lock, so what the first
-- statement finds is what the next one changes. The requests come as one JSON array parameter
-- (json_each), so each statement has one text whatever the batch size. RETURNING names the
-- updated table's columns bare: SQLite refuses the alias there. The rules are the
-- engine's (agent_dispatch.stores._common: startable, fence_violation), as PostgreSQL's
-- statements.sql has them; the contract suite runs both ways against the same tests.

-- name: claimable
-- Whether a row can be leased now: ready and due, or leased or running with its lease expired.
-- Every claim of the SQLite store uses this one text (the claim of the next item, and {claimable}
-- below), as PostgreSQL's claims use their `claimable`.
state IN ('ready', 'leased', 'running')
AND CASE WHEN state = 'ready' THEN coalesce(not_before <= :now, 1) ELSE lease_expires_at <= :now END

-- name: start_candidates
-- The simply claimable items of [[id, tenant], ...]: the tenant as named; claimable; an attempt
-- left; the deadline not passed. In id order, which is the order their fencing tokens are given in.
SELECT w.id, w.state, w.lease_owner
FROM json_each(:claims) AS req
JOIN agent_dispatch_work_items AS w ON w.id = json_extract(req.value, '$[0]')
WHERE w.tenant = json_extract(req.value, '$[1]')
  AND w.attempt < w.max_attempts
  AND (w.deadline IS NULL OR w.deadline > :now)
  AND {claimable}
ORDER BY w.id

-- name: start_many
-- Lease and start each of [[id, token], ...] (the candidates above, with their new tokens).
UPDATE agent_dispatch_work_items AS w
SET state = 'running', attempt = w.attempt + 1, lease_epoch = w.lease_epoch + 1,
    fencing_token = json_extract(t.value, '$[1]'), lease_owner = :owner,
    lease_expires_at = :now + :ttl, not_before = NULL, commit_token = NULL, updated_at = :now
FROM json_each(:tokens) AS t
WHERE w.id = json_extract(t.value, '$[0]')
RETURNING id, tenant, lease_owner, lease_epoch, fencing_token, lease_expires_at, attempt, payload

-- name: commit_many
-- Commit each of [[id, tenant, owner, epoch, token, state, outcome, error], ...] whose lease is
-- the item's current, unexpired one, unless other items depend on it (commit() settles those).
UPDATE agent_dispatch_work_items AS w
SET state = json_extract(c.value, '$[5]'), outcome = json_extract(c.value, '$[6]'),
    error = json_extract(c.value, '$[7]'), commit_token = w.fencing_token,
    lease_expires_at = NULL, updated_at = :now
FROM json_each(:commits) AS c
WHERE w.id = json_extract(c.value, '$[0]')
  AND w.tenant = json_extract(c.value, '$[1]')
  AND w.lease_owner = json_extract(c.value, '$[2]')
  AND w.lease_epoch = json_extract(c.value, '$[3]')
  AND w.fencing_token = json_extract(c.value, '$[4]')
  AND w.state IN ('leased', 'running')
  AND w.lease_expires_at > :now
  AND NOT EXISTS (SELECT 1 FROM agent_dispatch_dependencies AS d WHERE d.dependency = w.id)
RETURNING {columns}

-- name: take_tokens
-- :n fencing tokens at once: the caller numbers them from the returned value - :n + 1 up.
UPDATE agent_dispatch_counters SET value = value + :n WHERE name = 'fencing_token' RETURNING value

-- name: any_existing
-- Whether any of the ids :ids or [tenant, idempotency key] pairs :keys is taken already.
SELECT 1 FROM json_each(:ids) AS i JOIN agent_dispatch_work_items AS w ON w.id = i.value
UNION ALL
SELECT 1 FROM json_each(:keys) AS k JOIN agent_dispatch_work_items AS w
    ON w.tenant = json_extract(k.value, '$[0]') AND w.idempotency_key = json_extract(k.value, '$[1]')
LIMIT 1

-- name: insert_new
-- A new item without dependencies: ready, no attempt yet, no lease (the other columns stay NULL).
INSERT INTO agent_dispatch_work_items (
    id, tenant, kind, queue, session_id, state, priority, deadline, attempt, max_attempts,
    lease_epoch, fencing_token, idempotency_key, depends_on, pending_deps, fairness_group,
    payload, payload_size, payload_digest, created_at, updated_at, last_dispatched_at
) VALUES (?, ?, ?, ?, ?, 'ready', ?, ?, 0, ?, 0, 0, ?, '[]', 0, ?, ?, ?, ?, ?, ?, ?)
