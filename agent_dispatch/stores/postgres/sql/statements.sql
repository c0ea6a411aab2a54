-- The statements of the PostgreSQL WorkItem store, as str.format templates rendered once at
-- import by agent_dispatch.stores.postgres.statements. Fields every section may use: {now} (the
-- authority's clock, shifted only by the test hook), {item} (the WorkItem columns), {outcome_cols}
-- (the provenance record's columns), {return_item} and {return_w} (a statement's returned row,
-- unqualified or of the alias w), {active} and {non_terminal} (state sets). Others are named
-- where they are used. Array parameters go in binary (%(x)b): psycopg's text array dumper quotes
-- every element with a regular expression, about a fifth of a batch submitter's CPU.

-- name: now
-- The authority's clock; ``off`` is 0 in production.
(now() + %(off)s::float8 * interval '1 second')

-- name: active
state IN ('ready', 'leased', 'running')

-- name: non_terminal
state IN ('submitted', 'ready', 'leased', 'running')

-- name: fence
-- The row is held by exactly this lease ({id}... name where its fields come from). The expiry is
-- written as a difference, not ``lease_expires_at > now``: that form would tempt the planner into
-- the lease-expiry index (cost: every live lease) instead of the primary key (one row).
id = {id} AND tenant = {tenant} AND lease_owner = {owner} AND lease_epoch = {epoch} AND fencing_token = {token} AND state IN ('leased', 'running') AND lease_expires_at - {now} > interval '0'

-- name: no_dependents
-- The single-statement fast path: an item nobody depends on needs nothing else in its transaction.
 AND NOT has_dependents

-- name: no_cascade
-- A claim or retry that cannot dead-letter, or can without dependents to cancel.
 AND (attempt < max_attempts OR NOT has_dependents)

-- name: event_select
-- One provenance record per row of the ``upd`` CTE, in {outcome_cols} order.
SELECT id, tenant, {event}, {owner}, lease_epoch, fencing_token, updated_at, {outcome}, {detail} FROM upd

-- name: event
INSERT INTO agent_dispatch_outcomes ({outcome_cols}) {select}

-- name: select_view
SELECT {item}, commit_token, lease_expires_at > {now} AS live, (not_before IS NULL OR not_before <= {now}) AS due FROM agent_dispatch_work_items WHERE id = %(id)s

-- name: select_item
SELECT {item} FROM agent_dispatch_work_items WHERE id = %(id)s

-- name: select_items
SELECT {item} FROM agent_dispatch_work_items WHERE id = ANY(%(ids)s)

-- name: select_by_key
SELECT {item}, payload_digest FROM agent_dispatch_work_items WHERE tenant = %(tenant)s AND idempotency_key = %(key)s

-- name: select_by_id_for_submit
SELECT {item}, payload_digest FROM agent_dispatch_work_items WHERE id = %(id)s

-- name: lock_dependencies
-- Lock the dependencies in id order (no deadlock between two submits) and flag them, so their own
-- terminal transition learns, from the row it locks, that it has dependents to update.
UPDATE agent_dispatch_work_items SET has_dependents = true WHERE id IN (SELECT id FROM agent_dispatch_work_items WHERE id = ANY(%(deps)s) AND tenant = %(tenant)s ORDER BY id FOR UPDATE) RETURNING id, state

-- name: insert_item
WITH ins AS (
    INSERT INTO agent_dispatch_work_items (id, tenant, kind, queue, session_id, state, priority, deadline, attempt,
                     max_attempts, idempotency_key, depends_on, pending_deps, fairness_group,
                     payload, payload_size, payload_digest, outcome, error, created_at, updated_at,
                     last_dispatched_at)
    VALUES (%(id)s, %(tenant)s, %(kind)s, %(queue)s, %(session_id)s, %(state)s, %(priority)s,
            %(deadline)s, 0, %(max_attempts)s, %(key)s, %(depends_on)s, %(pending)s,
            %(fairness_group)s, %(payload)s, %(payload_size)s, %(digest)s, %(outcome)s, %(error)s,
            {now}, {now}, CASE WHEN %(dispatched)s AND %(state)s = 'ready' THEN {now} END)
    ON CONFLICT DO NOTHING
    RETURNING {item}
), ev AS (
    INSERT INTO agent_dispatch_outcomes ({outcome_cols})
    SELECT id, tenant, 'submit', NULL, 0, 0, created_at, NULL, NULL FROM ins
    UNION ALL
    SELECT id, tenant, 'cancel', NULL, 0, 0, created_at, outcome, error FROM ins WHERE state = 'cancelled'
)
SELECT * FROM ins

-- name: insert_many
-- A batch of ready items without dependencies in one statement (submit_many_in_transaction): a
-- request whose id or idempotency key exists already (or earlier in the batch) is not returned.
WITH input AS (
    SELECT * FROM unnest(%(ids)b::text[], %(tenants)b::text[], %(kinds)b::text[], %(queues)b::text[],
                         %(sessions)b::text[], %(priorities)b::integer[], %(deadlines)b::timestamptz[],
                         %(max_attempts)b::integer[], %(keys)b::text[], %(groups)b::text[],
                         %(payloads)b::bytea[], %(digests)b::bytea[])
           WITH ORDINALITY AS u(id, tenant, kind, queue, session_id, priority, deadline, max_attempts,
                                idempotency_key, fairness_group, payload, payload_digest, ord)
), ins AS (
    INSERT INTO agent_dispatch_work_items (id, tenant, kind, queue, session_id, state, priority, deadline, attempt,
                     max_attempts, idempotency_key, fairness_group, payload, payload_size,
                     payload_digest, created_at, updated_at, last_dispatched_at)
    SELECT id, tenant, kind, queue, session_id, 'ready', priority, deadline, 0, max_attempts,
           idempotency_key, fairness_group, payload, octet_length(payload), payload_digest,
           {now}, {now}, CASE WHEN %(dispatched)s THEN {now} END
      FROM input ORDER BY ord
    ON CONFLICT DO NOTHING
    RETURNING {item}
), ev AS (
    INSERT INTO agent_dispatch_outcomes ({outcome_cols})
    SELECT id, tenant, 'submit', NULL, 0, 0, created_at, NULL, NULL FROM ins
)
SELECT * FROM ins

-- name: insert_dependencies
INSERT INTO agent_dispatch_dependencies (dependency, dependent) SELECT unnest(%(deps)b::text[]), %(id)s

-- name: take
-- Lease each ``cand`` row into state {leased} (start_many takes it straight to 'running'), or
-- dead-letter it when another attempt would exceed its maximum. {named}: the rows are among the
-- ``ids`` array, which gives the planner a primary-key path to them however few rows it believes
-- the table holds (else a small table is scanned whole).
    UPDATE agent_dispatch_work_items w SET
        state = CASE WHEN w.attempt < w.max_attempts THEN '{leased}' ELSE 'dead_letter' END,
        attempt = CASE WHEN w.attempt < w.max_attempts THEN w.attempt + 1 ELSE w.attempt END,
        lease_epoch = CASE WHEN w.attempt < w.max_attempts THEN w.lease_epoch + 1 ELSE w.lease_epoch END,
        fencing_token = CASE WHEN w.attempt < w.max_attempts THEN nextval('agent_dispatch_fencing_token_seq') ELSE w.fencing_token END,
        lease_owner = CASE WHEN w.attempt < w.max_attempts THEN %(owner)s ELSE w.lease_owner END,
        lease_expires_at = CASE WHEN w.attempt < w.max_attempts THEN {now} + %(ttl)s::float8 * interval '1 second' END,
        not_before = NULL,
        commit_token = NULL,
        outcome = CASE WHEN w.attempt < w.max_attempts THEN w.outcome ELSE 'failed' END,
        error = CASE WHEN w.attempt < w.max_attempts THEN w.error
                ELSE 'attempts exhausted (' || w.attempt || ' of ' || w.max_attempts || ')' END,
        updated_at = {now}
    FROM cand WHERE w.id = cand.cid AND cand.simple{named}
    RETURNING {return_w}, cand.prev_state, cand.prev_owner{returning}

-- name: take_named
 AND w.id = ANY(%(ids)b::text[])

-- name: take_named_one
 AND w.id = %(id)s

-- name: take_event
-- The 'claim' (or 'dead_letter') record of each row ``take`` updated, {then} more.
    INSERT INTO agent_dispatch_outcomes ({outcome_cols})
    SELECT id, tenant, CASE WHEN state = '{leased}' THEN 'claim' ELSE 'dead_letter' END, lease_owner,
           lease_epoch, fencing_token, updated_at,
           CASE WHEN state = '{leased}' THEN NULL ELSE outcome END,
           CASE WHEN state <> '{leased}' THEN error
                WHEN prev_state <> 'ready' THEN 'reclaimed an expired lease held by ' || prev_owner END
    FROM upd{then}

-- name: claimable
{active} AND CASE WHEN state = 'ready' THEN coalesce(not_before <= {now}, true) ELSE lease_expires_at <= {now} END

-- name: claim_next
-- The claim of the next item, one autocommit statement; a text per {filters}, each with its plan.
-- It leases the first claimable item, or dead-letters it when its attempts are spent. One case it
-- leaves alone: spent attempts *and* dependents, whose cancellation needs a second statement in
-- the same transaction. Then it returns only the candidate's id (``candidate``, with NULL item
-- columns) and the caller claims that item by name in a transaction, keeping the order.
WITH cand AS (
    SELECT id AS cid, state AS prev_state, lease_owner AS prev_owner,
           (attempt < max_attempts OR NOT has_dependents) AS simple
    FROM agent_dispatch_work_items
    WHERE {claimable}{filters}
    ORDER BY priority DESC, seq
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), upd AS ({take}), ev AS ({take_event})
SELECT cand.cid AS candidate, upd.* FROM cand LEFT JOIN upd ON upd.id = cand.cid

-- name: filter_queue
 AND queue = %(queue)s

-- name: filter_tenant
 AND tenant = %(tenant)s

-- name: claim_named
-- The claim of one named item; the fast (autocommit) form's {simple} leaves the spent-with-
-- dependents case to the transactional form, like the next-item claim does.
WITH cand AS (
    SELECT id AS cid, state AS prev_state, lease_owner AS prev_owner, {simple} AS simple FROM agent_dispatch_work_items
    WHERE id = %(id)s AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s) AND {claimable}
    FOR UPDATE
), upd AS ({take}), ev AS ({take_event})
SELECT * FROM upd

-- name: mark_running
WITH upd AS (
    UPDATE agent_dispatch_work_items SET state = 'running', updated_at = {now}
    WHERE {fence} AND state = 'leased'
    RETURNING {return_item}
), ev AS ({event})
SELECT * FROM upd

-- name: start_many
-- Claim + mark_running for a batch of named items, one autocommit statement. Only the simply
-- claimable are taken (attempts left, so no dead letter and nothing to cascade; deadline not
-- passed; tenant as named); a row another transaction has locked is skipped, not waited for. The
-- records are 'claim' then 'running' per item (a UNION ALL is inserted branch by branch, in
-- order). Each named row is found by a lateral primary-key lookup: joined to the unnested arrays
-- instead, the cached generic plan scanned every active item (the whole queue) for each batch.
WITH cand AS (
    SELECT w.id AS cid, w.state AS prev_state, w.lease_owner AS prev_owner, true AS simple
    FROM unnest(%(ids)b::text[], %(tenants)b::text[]) AS req(rid, rtenant)
    CROSS JOIN LATERAL (
        SELECT id, state, lease_owner FROM agent_dispatch_work_items
        WHERE id = req.rid AND tenant = req.rtenant AND {claimable} AND attempt < max_attempts
          AND (deadline IS NULL OR deadline - {now} > interval '0')
        FOR UPDATE SKIP LOCKED
    ) AS w
), upd AS ({take}), ev AS ({take_event})
SELECT * FROM upd

-- name: start_one
-- start_many for a batch of one (an idle worker's claim), with scalar parameters. PostgreSQL plans
-- start_many afresh on every call (a custom plan, since the planner reads a bound array's length
-- and a generic plan assumes more rows); this text gets the plan cache's generic plan after a few
-- calls on a connection, which spares a lone turn the planning on its way to the executor.
WITH cand AS (
    SELECT id AS cid, state AS prev_state, lease_owner AS prev_owner, true AS simple
    FROM agent_dispatch_work_items
    WHERE id = %(id)s AND tenant = %(tenant)s AND {claimable} AND attempt < max_attempts
      AND (deadline IS NULL OR deadline - {now} > interval '0')
    FOR UPDATE SKIP LOCKED
), upd AS ({take}), ev AS ({take_event})
SELECT * FROM upd

-- name: renew
UPDATE agent_dispatch_work_items SET lease_expires_at = {now} + %(ttl)s::float8 * interval '1 second', updated_at = {now} WHERE {fence} RETURNING {item}

-- name: commit
-- The fenced terminal commit of one lease ({where}: commit_one), or of every lease in the arrays
-- of commit_batch (commit_many).
WITH upd AS (
    UPDATE agent_dispatch_work_items SET state = {state}, outcome = {outcome}, error = {error},
        commit_token = fencing_token, lease_expires_at = NULL, updated_at = {now}{where}
    RETURNING {return_item}
), ev AS ({event})
SELECT * FROM upd

-- name: commit_one

    WHERE {fence}{extra}

-- name: commit_batch
-- A batch finds and locks each fenced row by a lateral primary-key lookup, then updates what it
-- locked, again by primary key: with the fence in the UPDATE's own WHERE, the generic plan walked
-- every live lease (the lease-expiry index) for each batch. One row per lease, columns c_<field>.
 FROM (
        SELECT c.*, w.wid FROM unnest(%(ids)b::text[], %(tenants)b::text[], %(owners)b::text[], %(epochs)b::bigint[], %(tokens)b::bigint[], %(states)b::text[], %(outcomes)b::text[], %(errors)b::text[]) AS c(c_id, c_tenant, c_owner, c_epoch, c_token, c_state, c_outcome, c_error)
        CROSS JOIN LATERAL (SELECT id AS wid FROM agent_dispatch_work_items WHERE {fence}{extra} FOR UPDATE) AS w
    ) AS c
    WHERE id = c.wid AND id = ANY(%(ids)b::text[])

-- name: retry
WITH upd AS (
    UPDATE agent_dispatch_work_items SET
        state = CASE WHEN attempt >= max_attempts THEN 'dead_letter' ELSE 'ready' END,
        not_before = CASE WHEN attempt >= max_attempts THEN NULL
                          ELSE {now} + %(backoff)s::float8 * interval '1 second' END,
        lease_owner = CASE WHEN attempt >= max_attempts THEN lease_owner END,
        outcome = 'failed', error = %(error)s, commit_token = fencing_token,
        lease_expires_at = NULL, updated_at = {now}
    WHERE {fence}{extra}
    RETURNING {return_item}
), ev AS ({event})
SELECT * FROM upd

-- name: defer
WITH upd AS (
    UPDATE agent_dispatch_work_items SET state = 'ready', attempt = greatest(attempt - 1, 0),
        not_before = CASE WHEN %(delay)s::float8 > 0
                          THEN {now} + %(delay)s::float8 * interval '1 second' END,
        lease_owner = NULL, lease_expires_at = NULL, commit_token = NULL, updated_at = {now}
    WHERE {fence}
    RETURNING {return_item}
), ev AS ({event})
SELECT * FROM upd

-- name: cancel
WITH upd AS (
    UPDATE agent_dispatch_work_items SET state = 'cancelled', outcome = 'cancelled', error = %(reason)s,
        lease_expires_at = NULL, updated_at = {now}
    WHERE id = %(id)s AND tenant = %(tenant)s AND {non_terminal}
    RETURNING {return_item}
), ev AS ({event})
SELECT * FROM upd

-- name: dead_letter
WITH upd AS (
    UPDATE agent_dispatch_work_items SET state = 'dead_letter', error = %(reason)s, lease_expires_at = NULL, updated_at = {now}
    WHERE id = %(id)s AND {non_terminal}
    RETURNING {return_item}
), ev AS ({event})
SELECT * FROM upd

-- name: expire
WITH cand AS (
    SELECT id AS cid FROM agent_dispatch_work_items
    WHERE deadline IS NOT NULL AND {non_terminal} AND deadline <= {now}
    ORDER BY deadline LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), upd AS (
    UPDATE agent_dispatch_work_items w SET state = 'cancelled', outcome = 'cancelled', error = 'deadline expired',
        lease_expires_at = NULL, updated_at = {now}
    FROM cand WHERE w.id = cand.cid
    RETURNING {return_w}
), ev AS ({event})
SELECT * FROM upd

-- name: cascade
-- One level of a cascade: a statement of its own, after the parent's row is locked, so it sees
-- any dependent whose submit committed while the parent's transaction waited for that lock.
WITH upd AS (
    UPDATE agent_dispatch_work_items w SET state = 'cancelled', outcome = 'cancelled', error = %(reason)s,
        lease_expires_at = NULL, updated_at = {now}
    FROM agent_dispatch_dependencies d
    WHERE d.dependency = %(parent)s AND w.id = d.dependent AND w.{non_terminal}
    RETURNING {return_w}
), ev AS ({event})
SELECT id, state, has_dependents FROM upd

-- name: release
-- A dependency succeeded: count its waiting dependents down; those at zero become ready and are
-- returned, for the committer to dispatch in the same transaction (or right after it).
WITH upd AS (
    UPDATE agent_dispatch_work_items w SET pending_deps = greatest(w.pending_deps - 1, 0),
        state = CASE WHEN w.pending_deps <= 1 THEN 'ready' ELSE 'submitted' END,
        updated_at = {now}
    FROM agent_dispatch_dependencies d
    WHERE d.dependency = %(parent)s AND w.id = d.dependent AND w.state = 'submitted'
    RETURNING {return_w}
), ev AS (
    INSERT INTO agent_dispatch_outcomes ({outcome_cols})
    SELECT id, tenant, 'ready', lease_owner, lease_epoch, fencing_token, updated_at, NULL,
           'dependency ' || %(parent)s || ' succeeded'
    FROM upd WHERE state = 'ready'
)
SELECT * FROM upd WHERE state = 'ready'

-- name: recoverable
(SELECT {item} FROM agent_dispatch_work_items
 WHERE state IN ('leased', 'running') AND lease_expires_at <= {now}
 ORDER BY lease_expires_at LIMIT %(limit)s)
UNION ALL
(SELECT {item} FROM agent_dispatch_work_items
 WHERE state = 'ready'
   AND (last_dispatched_at IS NULL OR last_dispatched_at <= {now} - %(stale)s::float8 * interval '1 second')
   AND (not_before IS NULL OR not_before <= {now})
 ORDER BY last_dispatched_at NULLS FIRST LIMIT %(limit)s)

-- name: mark_dispatched
UPDATE agent_dispatch_work_items SET last_dispatched_at = {now} WHERE id = ANY(%(ids)s)

-- name: select_outcomes
SELECT {outcome_cols} FROM agent_dispatch_outcomes WHERE work_item_id = %(id)s ORDER BY seq

-- name: select_payload
SELECT payload FROM agent_dispatch_work_items WHERE id = %(id)s AND tenant = %(tenant)s

-- name: select_now
SELECT {now} AS now

-- name: list_items
SELECT {item} FROM agent_dispatch_work_items WHERE {where} ORDER BY seq DESC LIMIT %(limit)s

-- name: list_tenant
tenant = %(tenant)s

-- name: list_states
state = ANY(%(states)s)

-- name: list_after
seq < (SELECT seq FROM agent_dispatch_work_items WHERE id = %(after)s AND tenant = %(tenant)s)
