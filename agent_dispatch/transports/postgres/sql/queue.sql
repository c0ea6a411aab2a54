-- The PostgreSQL queue's current shape and functions, asserted on every start (idempotent:
-- IF NOT EXISTS, CREATE OR REPLACE FUNCTION). Run as one script, after any upgrade step.
CREATE TABLE IF NOT EXISTS agent_dispatch_queue (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    work_item_id text NOT NULL UNIQUE,
    session_id   text NOT NULL,
    tenant_ref   bytea NOT NULL,
    group_ref    bytea NOT NULL,
    priority     integer NOT NULL,
    deadline     timestamptz,
    enqueued_at  timestamptz NOT NULL DEFAULT now(),
    state        "char" NOT NULL CHECK (state IN ('r', 'c', 'd')),
    visible_at   timestamptz NOT NULL,
    claim_owner  text,
    claim_token  uuid,
    claimed_at   timestamptz,
    deliveries   integer NOT NULL DEFAULT 0,
    wire         bytea NOT NULL
);
-- The within-lane order (deadline, enqueue time, id) of ready rows: the claim reads its first entry.
CREATE INDEX IF NOT EXISTS agent_dispatch_queue_lane_order
    ON agent_dispatch_queue (tenant_ref, group_ref, priority, deadline, enqueued_at, id)
    WHERE state = 'r';
-- Expired-deadline rows go first; this probe is empty (one index descent) in normal operation.
CREATE INDEX IF NOT EXISTS agent_dispatch_queue_expiry
    ON agent_dispatch_queue (deadline)
    WHERE state = 'r' AND deadline IS NOT NULL;
-- Claims whose visibility timed out and delays that elapsed, made ready again by the claim.
CREATE INDEX IF NOT EXISTS agent_dispatch_queue_wakeup
    ON agent_dispatch_queue (visible_at)
    WHERE state <> 'r';

CREATE TABLE IF NOT EXISTS agent_dispatch_queue_tenant (
    tenant_ref bytea PRIMARY KEY,
    served     bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS agent_dispatch_queue_group (
    tenant_ref bytea NOT NULL,
    group_ref  bytea NOT NULL,
    served     bigint NOT NULL,
    PRIMARY KEY (tenant_ref, group_ref)
);
CREATE TABLE IF NOT EXISTS agent_dispatch_queue_count (
    tenant_ref bytea NOT NULL,
    group_ref  bytea NOT NULL,
    queued     bigint NOT NULL CHECK (queued >= 0),
    PRIMARY KEY (tenant_ref, group_ref)
);
CREATE TABLE IF NOT EXISTS agent_dispatch_queue_tenant_lane (
    tenant_ref    bytea NOT NULL,
    priority      integer NOT NULL,
    tenant_served bigint NOT NULL,
    ready         bigint NOT NULL,
    PRIMARY KEY (tenant_ref, priority)
);
CREATE INDEX IF NOT EXISTS agent_dispatch_queue_tenant_lane_next
    ON agent_dispatch_queue_tenant_lane (priority DESC, tenant_served)
    WHERE ready > 0;
CREATE TABLE IF NOT EXISTS agent_dispatch_queue_group_lane (
    tenant_ref   bytea NOT NULL,
    group_ref    bytea NOT NULL,
    priority     integer NOT NULL,
    group_served bigint NOT NULL,
    ready        bigint NOT NULL,
    PRIMARY KEY (tenant_ref, group_ref, priority)
);
CREATE INDEX IF NOT EXISTS agent_dispatch_queue_group_lane_next
    ON agent_dispatch_queue_group_lane (tenant_ref, priority, group_served)
    WHERE ready > 0;

CREATE TABLE IF NOT EXISTS agent_dispatch_queue_depth (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    depth     bigint NOT NULL CHECK (depth >= 0)
);
INSERT INTO agent_dispatch_queue_depth (singleton, depth) VALUES (true, 0) ON CONFLICT DO NOTHING;

CREATE SEQUENCE IF NOT EXISTS agent_dispatch_queue_serve_seq;

-- Make due rows ready again: claims whose visibility timed out, delays that elapsed. Rows of a
-- tenant another transaction holds are left for the next call (SKIP LOCKED: never waits).
CREATE OR REPLACE FUNCTION agent_dispatch_queue_wake(p_limit integer) RETURNS integer
LANGUAGE sql AS $fn$
    WITH due AS (
        SELECT q.id
          FROM agent_dispatch_queue q
          JOIN agent_dispatch_queue_tenant t ON t.tenant_ref = q.tenant_ref
         WHERE q.state <> 'r' AND q.visible_at <= now()
         ORDER BY q.visible_at
         LIMIT p_limit
           FOR UPDATE OF q, t SKIP LOCKED
    ), woke AS (
        UPDATE agent_dispatch_queue q
           SET state = 'r', claim_owner = NULL, claim_token = NULL, claimed_at = NULL, visible_at = now()
          FROM due
         WHERE q.id = due.id
        RETURNING q.tenant_ref, q.group_ref, q.priority
    ), tl AS (
        UPDATE agent_dispatch_queue_tenant_lane l
           SET ready = l.ready + c.n
          FROM (SELECT tenant_ref, priority, count(*) AS n FROM woke GROUP BY 1, 2) c
         WHERE l.tenant_ref = c.tenant_ref AND l.priority = c.priority
    ), gl AS (
        UPDATE agent_dispatch_queue_group_lane l
           SET ready = l.ready + c.n
          FROM (SELECT tenant_ref, group_ref, priority, count(*) AS n FROM woke GROUP BY 1, 2, 3) c
         WHERE l.tenant_ref = c.tenant_ref AND l.group_ref = c.group_ref AND l.priority = c.priority
    )
    SELECT count(*)::integer FROM woke
$fn$;

-- Claim up to p_max rows for p_owner in the documented order. Returns the claimed rows, in order.
--
-- Per claimed row: one statement picks it (lane, tenant lock, group, row) and one stamps it (the
-- row, the tenant's and group's history and their lanes). The wake-up and the expired-deadline
-- probes are each one read of the first entry of a partial index, once per call.
--
-- Generic plans only: with the default plan cache mode the first-round statement (LIMIT p_max) was
-- planned afresh on every call, which cost more than running it (300 us per call on an empty queue,
-- 80 us with generic plans). Every statement here is index probes whatever the parameters.
CREATE OR REPLACE FUNCTION agent_dispatch_queue_claim(p_owner text, p_max integer, p_visibility interval)
RETURNS TABLE (id bigint, work_item_id text, wire bytea, claim_token uuid, claimed_at timestamptz,
               deliveries integer)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    v_id          bigint;
    v_tenant      bytea;
    v_group       bytea;
    v_prio        integer;
    v_lane_served bigint;
    v_served      bigint;
    v_gl_served   bigint;
    v_g_served    bigint;
    v_stamp       bigint;
    v_first       timestamptz;
    v_expired     boolean;
    v_claimed     integer := 0;
    v_attempt     integer;
    v_rows        integer;
    v_n           integer;
    a_tenants     bytea[];
    a_prios       integer[];
    a_lane_served bigint[];
    a_served      bigint[];
    a_groups      bytea[];
    a_gl_served   bigint[];
    a_g_served    bigint[];
    a_ids         bigint[];
    a_stamps      bigint[];
BEGIN
    -- Due rows (visibility timeouts, elapsed delays): the wake-up is a SQL function with
    -- data-modifying CTEs, planned afresh on every call, so it runs only when the first entry of
    -- its index is due. (Written as ORDER BY ... LIMIT 1 so the plan is that index's first entry;
    -- an EXISTS here was planned as a sequential scan of the queue.)
    SELECT q.visible_at INTO v_first
      FROM agent_dispatch_queue q WHERE q.state <> 'r' ORDER BY q.visible_at LIMIT 1;
    IF v_first <= now() THEN
        PERFORM agent_dispatch_queue_wake(256);
    END IF;
    -- Expired deadlines go first. now() is fixed for the call, so the set cannot grow but by
    -- concurrent commits; probe it per row only while the call has seen it non-empty.
    SELECT q.deadline INTO v_first
      FROM agent_dispatch_queue q WHERE q.state = 'r' AND q.deadline IS NOT NULL ORDER BY q.deadline LIMIT 1;
    v_expired := coalesce(v_first <= now(), false);
    -- Whole rounds at once. Claimed one by one, the first rows of the call come from distinct
    -- tenants in lane order: the best lane's tenant, once served, ranks after every tenant not
    -- served yet at that priority. So one statement locks up to the rest of p_max tenants in lane
    -- order and reads each one's least recently served group and that group's first row, and the
    -- longest prefix at the first tenant's priority whose stamps are current (as in the loop below)
    -- is claimed and stamped in one more statement, in that order. With these stamps visible the
    -- next round is the same pick again: the tenants just served rank after every other one (so a
    -- call asking for more rows than there are free tenants takes each one's next row, round after
    -- round, as the loop would, instead of one row per statement), and a tenant served meanwhile
    -- by another claimer is skipped or stops the prefix as in the first. The loop then takes over
    -- (lower priorities, stale stamps, expired deadlines).
    IF NOT v_expired AND p_max > 1 THEN
        LOOP
            SELECT array_agg(p.tenant_ref ORDER BY p.o), array_agg(p.priority ORDER BY p.o),
                   array_agg(p.lane_served ORDER BY p.o), array_agg(p.served ORDER BY p.o),
                   array_agg(gl.group_ref ORDER BY p.o), array_agg(gl.group_served ORDER BY p.o),
                   array_agg(gl.served ORDER BY p.o), array_agg(r.id ORDER BY p.o)
              INTO a_tenants, a_prios, a_lane_served, a_served, a_groups, a_gl_served, a_g_served, a_ids
              FROM (SELECT k.*, row_number() OVER () AS o
                      FROM (SELECT l.tenant_ref, l.priority, l.tenant_served AS lane_served, t.served
                              FROM agent_dispatch_queue_tenant_lane l
                              JOIN agent_dispatch_queue_tenant t ON t.tenant_ref = l.tenant_ref
                             WHERE l.ready > 0
                             ORDER BY l.priority DESC, l.tenant_served
                             LIMIT p_max - v_claimed
                               FOR UPDATE OF t SKIP LOCKED) k) p
              LEFT JOIN LATERAL (
                    SELECT x.group_ref, x.group_served, g.served
                      FROM agent_dispatch_queue_group_lane x
                      LEFT JOIN agent_dispatch_queue_group g
                        ON g.tenant_ref = x.tenant_ref AND g.group_ref = x.group_ref
                     WHERE x.tenant_ref = p.tenant_ref AND x.priority = p.priority AND x.ready > 0
                     ORDER BY x.group_served
                     LIMIT 1) gl ON true
              LEFT JOIN LATERAL (
                    SELECT q.id
                      FROM agent_dispatch_queue q
                     WHERE q.tenant_ref = p.tenant_ref AND q.group_ref = gl.group_ref
                       AND q.priority = p.priority AND q.state = 'r'
                     ORDER BY q.deadline, q.enqueued_at, q.id
                     LIMIT 1) r ON true;
            IF a_tenants IS NULL THEN
                -- No lane has ready rows whose tenant is free: the loop's pick would find none
                -- either (an empty claim, the most common kind with many claimers, stops here).
                RETURN;
            END IF;
            v_n := 0;
            WHILE v_n < cardinality(a_tenants)
                  AND a_prios[v_n + 1] = a_prios[1]
                  AND a_lane_served[v_n + 1] = a_served[v_n + 1]
                  AND a_gl_served[v_n + 1] = a_g_served[v_n + 1]
                  AND a_ids[v_n + 1] IS NOT NULL LOOP
                v_n := v_n + 1;
                a_stamps[v_n] := nextval('agent_dispatch_queue_serve_seq');
            END LOOP;
            EXIT WHEN v_n = 0;
            v_prio := a_prios[1];
            RETURN QUERY
                WITH b AS (
                    SELECT * FROM unnest(a_ids[1:v_n], a_tenants[1:v_n], a_groups[1:v_n], a_stamps[1:v_n])
                           WITH ORDINALITY AS b(id, t, g, stamp, o)
                ), c AS (
                    UPDATE agent_dispatch_queue q
                       SET state = 'c', claim_owner = p_owner, claim_token = gen_random_uuid(),
                           claimed_at = clock_timestamp(), visible_at = now() + p_visibility,
                           deliveries = q.deliveries + 1
                      FROM b
                     -- (state NOT IN rather than = 'r', which planners matched to the lane index)
                     WHERE q.id = ANY(a_ids[1:v_n]) AND q.id = b.id AND q.state NOT IN ('c', 'd')
                    RETURNING q.id, q.work_item_id, q.wire, q.claim_token, q.claimed_at, q.deliveries,
                              b.t, b.g, b.stamp, b.o
                ), st AS (
                    UPDATE agent_dispatch_queue_tenant t SET served = c.stamp FROM c WHERE t.tenant_ref = c.t
                ), sg AS (
                    UPDATE agent_dispatch_queue_group g SET served = c.stamp
                      FROM c WHERE g.tenant_ref = c.t AND g.group_ref = c.g
                ), lt AS (
                    UPDATE agent_dispatch_queue_tenant_lane l
                       SET tenant_served = c.stamp, ready = l.ready - (l.priority = v_prio)::integer
                      FROM c WHERE l.tenant_ref = c.t
                ), lg AS (
                    UPDATE agent_dispatch_queue_group_lane l
                       SET group_served = c.stamp, ready = l.ready - (l.priority = v_prio)::integer
                      FROM c WHERE l.tenant_ref = c.t AND l.group_ref = c.g
                )
                SELECT c.id, c.work_item_id, c.wire, c.claim_token, c.claimed_at, c.deliveries
                  FROM c ORDER BY c.o;
            GET DIAGNOSTICS v_rows = ROW_COUNT;
            v_claimed := v_claimed + v_rows;
            -- (fewer rows than picked is never expected: each was picked under its tenant's lock)
            EXIT WHEN v_rows < v_n OR v_claimed >= p_max;
        END LOOP;
    END IF;
    WHILE v_claimed < p_max LOOP
        v_id := NULL;
        IF v_expired THEN
            SELECT q.id, q.tenant_ref, q.group_ref, q.priority
              INTO v_id, v_tenant, v_group, v_prio
              FROM agent_dispatch_queue q
              JOIN agent_dispatch_queue_tenant t ON t.tenant_ref = q.tenant_ref
              JOIN agent_dispatch_queue_group g ON g.tenant_ref = q.tenant_ref AND g.group_ref = q.group_ref
             WHERE q.state = 'r' AND q.deadline <= now()
             ORDER BY q.priority DESC, t.served, g.served, q.deadline, q.enqueued_at, q.id
             LIMIT 1
               FOR UPDATE OF q, t SKIP LOCKED;
            v_expired := v_id IS NOT NULL;
        END IF;
        -- Otherwise the best lane (highest priority, then least recently served tenant whose
        -- history row no concurrent claimer holds), that tenant's least recently served group at
        -- that priority, and that lane's first row (deadline, enqueue time, id), in one statement.
        -- The lane, group and row are read from the statement's snapshot, the tenant row as locked
        -- (its newest version): every claim stamps the tenant and its lanes with a new unique
        -- stamp, so equal stamps mean no claim of this tenant committed since the snapshot and the
        -- snapshot's view of the tenant is current. Rows of a tenant are only claimed under its lock.
        --
        -- (This is the first round's pick with LIMIT 1, written out again on purpose. One pick with
        -- LIMIT v_limit for both, and one array stamp, was measured on 2026-12-06 by interleaving
        -- both functions on one queue: claims of 1 took 10-19% longer and claims of 16 took 4-10%
        -- longer. Under a generic plan a LIMIT parameter is planned for many rows, with Memoize
        -- nodes around the lateral reads; the constant 1 gives the plain nested loop.)
        v_attempt := 0;
        WHILE v_id IS NULL AND v_attempt < 8 LOOP
            v_attempt := v_attempt + 1;
            v_tenant := NULL;
            SELECT p.tenant_ref, p.priority, p.lane_served, p.served,
                   gl.group_ref, gl.group_served, gl.served, r.id
              INTO v_tenant, v_prio, v_lane_served, v_served, v_group, v_gl_served, v_g_served, v_id
              FROM (SELECT l.tenant_ref, l.priority, l.tenant_served AS lane_served, t.served
                      FROM agent_dispatch_queue_tenant_lane l
                      JOIN agent_dispatch_queue_tenant t ON t.tenant_ref = l.tenant_ref
                     WHERE l.ready > 0
                     ORDER BY l.priority DESC, l.tenant_served
                     LIMIT 1
                       FOR UPDATE OF t SKIP LOCKED) p
              LEFT JOIN LATERAL (
                    SELECT x.group_ref, x.group_served, g.served
                      FROM agent_dispatch_queue_group_lane x
                      LEFT JOIN agent_dispatch_queue_group g
                        ON g.tenant_ref = x.tenant_ref AND g.group_ref = x.group_ref
                     WHERE x.tenant_ref = p.tenant_ref AND x.priority = p.priority AND x.ready > 0
                     ORDER BY x.group_served
                     LIMIT 1) gl ON true
              LEFT JOIN LATERAL (
                    SELECT q.id
                      FROM agent_dispatch_queue q
                     WHERE q.tenant_ref = p.tenant_ref AND q.group_ref = gl.group_ref
                       AND q.priority = p.priority AND q.state = 'r'
                     ORDER BY q.deadline, q.enqueued_at, q.id
                     LIMIT 1) r ON true;
            EXIT WHEN v_tenant IS NULL;
            IF v_lane_served IS DISTINCT FROM v_served THEN
                -- Served since the snapshot (then this only re-reads), or a lane created by an
                -- admission with an older copy of the stamp: either way, pick again. A copy is never
                -- newer than the tenant's stamp, so a stale lane is only ever met too early.
                v_id := NULL;
                UPDATE agent_dispatch_queue_tenant_lane SET tenant_served = v_served
                 WHERE tenant_ref = v_tenant AND tenant_served <> v_served;
                CONTINUE;
            END IF;
            IF v_group IS NOT NULL AND v_gl_served IS DISTINCT FROM v_g_served THEN
                v_id := NULL;
                UPDATE agent_dispatch_queue_group_lane SET group_served = v_g_served
                 WHERE tenant_ref = v_tenant AND group_ref = v_group AND group_served <> v_g_served;
                CONTINUE;
            END IF;
            IF v_id IS NULL THEN
                -- A lane counts ready rows that are not there: recount the tenant's lanes at this
                -- priority from the rows (never expected; keeps a bad count from blocking claims).
                UPDATE agent_dispatch_queue_group_lane l
                   SET ready = (SELECT count(*) FROM agent_dispatch_queue q
                                 WHERE q.tenant_ref = l.tenant_ref AND q.group_ref = l.group_ref
                                   AND q.priority = l.priority AND q.state = 'r')
                 WHERE l.tenant_ref = v_tenant AND l.priority = v_prio;
                UPDATE agent_dispatch_queue_tenant_lane l
                   SET ready = (SELECT count(*) FROM agent_dispatch_queue q
                                 WHERE q.tenant_ref = l.tenant_ref AND q.priority = l.priority AND q.state = 'r')
                 WHERE l.tenant_ref = v_tenant AND l.priority = v_prio;
            END IF;
        END LOOP;
        EXIT WHEN v_id IS NULL;

        -- Stamp the row and the fairness history in one statement; nothing is stamped unless the
        -- row was still ready.
        v_stamp := nextval('agent_dispatch_queue_serve_seq');
        RETURN QUERY
            WITH c AS (
                UPDATE agent_dispatch_queue q
                   SET state = 'c', claim_owner = p_owner, claim_token = gen_random_uuid(),
                       claimed_at = clock_timestamp(), visible_at = now() + p_visibility,
                       deliveries = q.deliveries + 1
                 WHERE q.id = v_id AND q.state = 'r'
                RETURNING q.id, q.work_item_id, q.wire, q.claim_token, q.claimed_at, q.deliveries
            ), st AS (
                UPDATE agent_dispatch_queue_tenant SET served = v_stamp
                 WHERE tenant_ref = v_tenant AND EXISTS (SELECT FROM c)
            ), sg AS (
                UPDATE agent_dispatch_queue_group SET served = v_stamp
                 WHERE tenant_ref = v_tenant AND group_ref = v_group AND EXISTS (SELECT FROM c)
            ), lt AS (
                UPDATE agent_dispatch_queue_tenant_lane
                   SET tenant_served = v_stamp, ready = ready - (priority = v_prio)::integer
                 WHERE tenant_ref = v_tenant AND EXISTS (SELECT FROM c)
            ), lg AS (
                UPDATE agent_dispatch_queue_group_lane
                   SET group_served = v_stamp, ready = ready - (priority = v_prio)::integer
                 WHERE tenant_ref = v_tenant AND group_ref = v_group AND EXISTS (SELECT FROM c)
            )
            SELECT * FROM c;
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        v_claimed := v_claimed + v_rows;
        EXIT WHEN v_rows = 0;  -- (never expected: the row is only claimed under its tenant's lock)
    END LOOP;
END
$fn$;

-- Compare-and-admit p_n more turns on the depth counter row, last in every admission's lock
-- order: O(1), never COUNT(*). p_bound NULL re-drives without the bound. The one place that
-- decides a refusal (AD001) and an unknown depth (AD002), for both admission functions below.
CREATE OR REPLACE FUNCTION agent_dispatch_queue_take_room(p_n bigint, p_bound bigint)
RETURNS void
LANGUAGE plpgsql AS $fn$
BEGIN
    IF p_bound IS NULL THEN
        UPDATE agent_dispatch_queue_depth SET depth = depth + p_n;
        RETURN;
    END IF;
    UPDATE agent_dispatch_queue_depth SET depth = depth + p_n WHERE depth + p_n <= p_bound;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT FROM agent_dispatch_queue_depth) THEN
            -- The depth is unknown, never taken as zero or as full.
            RAISE EXCEPTION 'the queue depth counter row is missing' USING ERRCODE = 'AD002';
        END IF;
        RAISE EXCEPTION 'queue depth would exceed %', p_bound USING ERRCODE = 'AD001';
    END IF;
END
$fn$;

-- Admit a batch all-or-nothing; p_bound NULL re-drives without the bound. Work items that
-- already have a queued delivery are skipped (never a second delivery). Returns rows inserted.
CREATE OR REPLACE FUNCTION agent_dispatch_queue_admit(
    p_work_item_ids text[], p_session_ids text[], p_tenant_refs bytea[], p_group_refs bytea[],
    p_priorities integer[], p_deadlines timestamptz[], p_not_befores timestamptz[], p_wires bytea[],
    p_bound bigint)
RETURNS bigint
LANGUAGE plpgsql AS $fn$
DECLARE
    c_new_base CONSTANT bigint := -4611686018427387904;  -- newcomers rank below every served stamp
    a_tenants bytea[];
    a_groups  bytea[];
    a_prios   integer[];
    a_ready   integer[];
    v_n       bigint;
BEGIN
    -- (The cheap refusal under overload is the enqueue path's depth pre-check; here only the
    -- counter decides, after the rows, so a replay of an already queued turn is never refused.)
    WITH input AS (
        SELECT * FROM unnest(p_work_item_ids, p_session_ids, p_tenant_refs, p_group_refs, p_priorities,
                             p_deadlines, p_not_befores, p_wires)
               AS u(work_item_id, session_id, tenant_ref, group_ref, priority, deadline, not_before, wire)
    ), ins AS (
        INSERT INTO agent_dispatch_queue AS q
               (work_item_id, session_id, tenant_ref, group_ref, priority, deadline, state, visible_at, wire)
        SELECT work_item_id, session_id, tenant_ref, group_ref, priority, deadline,
               CASE WHEN not_before > now() THEN 'd' ELSE 'r' END::"char",
               greatest(coalesce(not_before, now()), now()), wire
          FROM input
         ORDER BY work_item_id  -- unique-index waits in one order: no deadlock between batches
        ON CONFLICT (work_item_id) DO NOTHING
        RETURNING q.tenant_ref, q.group_ref, q.priority, (q.state = 'r')::integer AS ready
    )
    SELECT array_agg(tenant_ref), array_agg(group_ref), array_agg(priority), array_agg(ready)
      INTO a_tenants, a_groups, a_prios, a_ready
      FROM ins;
    v_n := coalesce(cardinality(a_tenants), 0);
    IF v_n = 0 THEN
        RETURN 0;
    END IF;
    -- Tenant history rows in tenant_ref order (the lock order), created for newcomers and locked
    -- (ON CONFLICT DO UPDATE locks the row even when its WHERE is false; it also re-inserts a row
    -- a concurrent prune deleted): until this transaction ends, claims skip these tenants and the
    -- prune leaves their history alone, so the rows admitted here always have their history.
    INSERT INTO agent_dispatch_queue_tenant AS t (tenant_ref, served)
    SELECT u.t, c_new_base + nextval('agent_dispatch_queue_serve_seq')
      FROM unnest(a_tenants) AS u(t)
     GROUP BY u.t
     ORDER BY u.t
    ON CONFLICT (tenant_ref) DO UPDATE SET served = t.served WHERE false;
    -- The rest is written under those tenant locks.
    INSERT INTO agent_dispatch_queue_group (tenant_ref, group_ref, served)
    SELECT u.t, u.g, c_new_base + nextval('agent_dispatch_queue_serve_seq')
      FROM unnest(a_tenants, a_groups) AS u(t, g)
     GROUP BY u.t, u.g
     ORDER BY u.t, u.g
    ON CONFLICT (tenant_ref, group_ref) DO NOTHING;
    INSERT INTO agent_dispatch_queue_tenant_lane AS l (tenant_ref, priority, tenant_served, ready)
    SELECT u.t, u.p, t.served, sum(u.r)
      FROM unnest(a_tenants, a_prios, a_ready) AS u(t, p, r)
      JOIN agent_dispatch_queue_tenant t ON t.tenant_ref = u.t
     GROUP BY u.t, u.p, t.served
     ORDER BY u.t, u.p
    ON CONFLICT (tenant_ref, priority) DO UPDATE SET ready = l.ready + excluded.ready;
    INSERT INTO agent_dispatch_queue_group_lane AS l (tenant_ref, group_ref, priority, group_served, ready)
    SELECT u.t, u.g, u.p, g.served, sum(u.r)
      FROM unnest(a_tenants, a_groups, a_prios, a_ready) AS u(t, g, p, r)
      JOIN agent_dispatch_queue_group g ON g.tenant_ref = u.t AND g.group_ref = u.g
     GROUP BY u.t, u.g, u.p, g.served
     ORDER BY u.t, u.g, u.p
    ON CONFLICT (tenant_ref, group_ref, priority) DO UPDATE SET ready = l.ready + excluded.ready;
    INSERT INTO agent_dispatch_queue_count AS c (tenant_ref, group_ref, queued)
    SELECT u.t, u.g, count(*)
      FROM unnest(a_tenants, a_groups) AS u(t, g)
     GROUP BY u.t, u.g
     ORDER BY u.t, u.g
    ON CONFLICT (tenant_ref, group_ref) DO UPDATE SET queued = c.queued + excluded.queued;
    PERFORM agent_dispatch_queue_take_room(v_n, p_bound);
    IF 1 = ANY(a_ready) THEN
        PERFORM pg_notify('agent_dispatch_queue', '');
    END IF;
    RETURN v_n;
END
$fn$;

-- Admit one turn: agent_dispatch_queue_admit for a batch of one, with the same effects in the
-- same lock order (queue row, tenant, group, tenant lane, group lane, count, depth). A lone
-- submit's admission is most submits' (the enqueue path, the gateway at low load), and the batch
-- function costs it three times the server time of this one (0.55 against 0.19 ms per call,
-- measured 2026-12-07): unnesting, aggregating and re-planning arrays of one. The two are kept
-- equal by tests/postgres/test_pg_admit_one.py, which admits the same turns both ways.
CREATE OR REPLACE FUNCTION agent_dispatch_queue_admit_one(
    p_work_item_id text, p_session_id text, p_tenant_ref bytea, p_group_ref bytea,
    p_priority integer, p_deadline timestamptz, p_not_before timestamptz, p_wire bytea, p_bound bigint)
RETURNS bigint
LANGUAGE plpgsql AS $fn$
DECLARE
    c_new_base CONSTANT bigint := -4611686018427387904;  -- as in agent_dispatch_queue_admit
    v_ready integer := (p_not_before IS NULL OR p_not_before <= now())::integer;
BEGIN
    INSERT INTO agent_dispatch_queue AS q
           (work_item_id, session_id, tenant_ref, group_ref, priority, deadline, state, visible_at, wire)
    VALUES (p_work_item_id, p_session_id, p_tenant_ref, p_group_ref, p_priority, p_deadline,
            CASE WHEN v_ready = 1 THEN 'r' ELSE 'd' END::"char", greatest(coalesce(p_not_before, now()), now()), p_wire)
    ON CONFLICT (work_item_id) DO NOTHING;
    IF NOT FOUND THEN
        RETURN 0;  -- already queued: never a second delivery
    END IF;
    -- The tenant row locked (or made) first, as in the batch function.
    INSERT INTO agent_dispatch_queue_tenant AS t (tenant_ref, served)
    VALUES (p_tenant_ref, c_new_base + nextval('agent_dispatch_queue_serve_seq'))
    ON CONFLICT (tenant_ref) DO UPDATE SET served = t.served WHERE false;
    INSERT INTO agent_dispatch_queue_group (tenant_ref, group_ref, served)
    VALUES (p_tenant_ref, p_group_ref, c_new_base + nextval('agent_dispatch_queue_serve_seq'))
    ON CONFLICT (tenant_ref, group_ref) DO NOTHING;
    INSERT INTO agent_dispatch_queue_tenant_lane AS l (tenant_ref, priority, tenant_served, ready)
    SELECT p_tenant_ref, p_priority, t.served, v_ready FROM agent_dispatch_queue_tenant t WHERE t.tenant_ref = p_tenant_ref
    ON CONFLICT (tenant_ref, priority) DO UPDATE SET ready = l.ready + excluded.ready;
    INSERT INTO agent_dispatch_queue_group_lane AS l (tenant_ref, group_ref, priority, group_served, ready)
    SELECT p_tenant_ref, p_group_ref, p_priority, g.served, v_ready FROM agent_dispatch_queue_group g
     WHERE g.tenant_ref = p_tenant_ref AND g.group_ref = p_group_ref
    ON CONFLICT (tenant_ref, group_ref, priority) DO UPDATE SET ready = l.ready + excluded.ready;
    INSERT INTO agent_dispatch_queue_count AS c (tenant_ref, group_ref, queued)
    VALUES (p_tenant_ref, p_group_ref, 1)
    ON CONFLICT (tenant_ref, group_ref) DO UPDATE SET queued = c.queued + 1;
    PERFORM agent_dispatch_queue_take_room(1, p_bound);
    IF v_ready = 1 THEN
        PERFORM pg_notify('agent_dispatch_queue', '');
    END IF;
    RETURN 1;
END
$fn$;

-- Acknowledge (delete) claimed rows whose receipt still matches: owner, token and claim time.
-- Returns the ids removed; a receipt not among them was stale or foreign.
--
-- Takes no tenant lock (claims hold those): it moves the counters and leaves emptied history to
-- agent_dispatch_queue_prune.
CREATE OR REPLACE FUNCTION agent_dispatch_queue_ack(p_ids bigint[], p_owners text[], p_tokens uuid[],
                                                    p_claimed timestamptz[])
RETURNS SETOF bigint
LANGUAGE plpgsql AS $fn$
DECLARE
    a_ids     bigint[];
    a_tenants bytea[];
    a_groups  bytea[];
BEGIN
    WITH r AS (
        SELECT * FROM unnest(p_ids, p_owners, p_tokens, p_claimed) AS u(id, owner, token, claimed_at)
         ORDER BY id
    ), del AS (
        DELETE FROM agent_dispatch_queue q
         USING r
         WHERE q.id = r.id AND q.state = 'c' AND q.claim_owner = r.owner AND q.claim_token = r.token
           AND q.claimed_at = r.claimed_at
        RETURNING q.id, q.tenant_ref, q.group_ref
    )
    SELECT array_agg(id), array_agg(tenant_ref), array_agg(group_ref) INTO a_ids, a_tenants, a_groups FROM del;
    IF a_ids IS NULL THEN
        RETURN;
    END IF;
    -- Counter rows in the lock order, then moved (an UPDATE ... FROM locks in plan order).
    PERFORM 1 FROM agent_dispatch_queue_count c
      WHERE (c.tenant_ref, c.group_ref) IN (SELECT * FROM unnest(a_tenants, a_groups))
      ORDER BY c.tenant_ref, c.group_ref
        FOR NO KEY UPDATE;
    UPDATE agent_dispatch_queue_count c SET queued = c.queued - n.n
      FROM (SELECT u.t, u.g, count(*) AS n FROM unnest(a_tenants, a_groups) AS u(t, g) GROUP BY u.t, u.g) n
     WHERE c.tenant_ref = n.t AND c.group_ref = n.g;
    UPDATE agent_dispatch_queue_depth SET depth = depth - cardinality(a_ids);
    RETURN QUERY SELECT unnest(a_ids);
END
$fn$;

-- Remove the fairness history (history rows, lanes, counters) of groups and tenants that have no
-- queued row left, examining at most p_limit counters at zero. Returns the groups removed.
--
-- Safe against every concurrent writer without waiting for any: a tenant is only touched while
-- this call holds its row (SKIP LOCKED, like a claim), and admissions lock that row before they
-- write a counter, so under the lock counters only go down (acknowledgements) and a counter at
-- zero (locked here, SKIP LOCKED again) stays at zero. A tenant goes with its last group.
CREATE OR REPLACE FUNCTION agent_dispatch_queue_prune(p_limit integer)
RETURNS integer
LANGUAGE plpgsql AS $fn$
DECLARE
    a_tenants bytea[];
    a_ct      bytea[];
    a_cg      bytea[];
BEGIN
    SELECT array_agg(k.tenant_ref) INTO a_tenants
      FROM (SELECT t.tenant_ref
              FROM agent_dispatch_queue_tenant t
             WHERE t.tenant_ref IN (SELECT c.tenant_ref FROM agent_dispatch_queue_count c
                                     WHERE c.queued = 0 LIMIT p_limit)
             ORDER BY t.tenant_ref
               FOR UPDATE SKIP LOCKED) k;
    IF a_tenants IS NULL THEN
        RETURN 0;
    END IF;
    SELECT array_agg(k.tenant_ref), array_agg(k.group_ref) INTO a_ct, a_cg
      FROM (SELECT c.tenant_ref, c.group_ref
              FROM agent_dispatch_queue_count c
             WHERE c.tenant_ref = ANY(a_tenants) AND c.queued = 0
             ORDER BY c.tenant_ref, c.group_ref
               FOR UPDATE SKIP LOCKED) k;
    IF a_ct IS NULL THEN
        RETURN 0;
    END IF;
    WITH gone AS (
        SELECT * FROM unnest(a_ct, a_cg) AS u(t, g)
    ), c AS (
        DELETE FROM agent_dispatch_queue_count c USING gone WHERE c.tenant_ref = gone.t AND c.group_ref = gone.g
    ), g AS (
        DELETE FROM agent_dispatch_queue_group g USING gone WHERE g.tenant_ref = gone.t AND g.group_ref = gone.g
    )
    DELETE FROM agent_dispatch_queue_group_lane l
     USING gone WHERE l.tenant_ref = gone.t AND l.group_ref = gone.g;
    WITH gone AS (
        DELETE FROM agent_dispatch_queue_tenant t
         WHERE t.tenant_ref = ANY(a_ct)
           AND NOT EXISTS (SELECT 1 FROM agent_dispatch_queue_count c WHERE c.tenant_ref = t.tenant_ref)
        RETURNING t.tenant_ref
    )
    DELETE FROM agent_dispatch_queue_tenant_lane l USING gone WHERE l.tenant_ref = gone.tenant_ref;
    RETURN cardinality(a_ct);
END
$fn$;

-- Give a claimed row back, visible again after p_delay. False when the receipt is stale.
CREATE OR REPLACE FUNCTION agent_dispatch_queue_release(p_id bigint, p_owner text, p_token uuid,
                                                        p_claimed timestamptz, p_delay interval)
RETURNS boolean
LANGUAGE plpgsql AS $fn$
DECLARE
    v_tenant bytea;
    v_group  bytea;
    v_prio   integer;
    v_state  "char";
BEGIN
    UPDATE agent_dispatch_queue q
       SET state = CASE WHEN p_delay > interval '0' THEN 'd' ELSE 'r' END::"char",
           visible_at = now() + greatest(p_delay, interval '0'),
           claim_owner = NULL, claim_token = NULL, claimed_at = NULL
     WHERE q.id = p_id AND q.state = 'c' AND q.claim_owner = p_owner AND q.claim_token = p_token
       AND q.claimed_at = p_claimed
    RETURNING q.tenant_ref, q.group_ref, q.priority, q.state INTO v_tenant, v_group, v_prio, v_state;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_state = 'r' THEN
        PERFORM 1 FROM agent_dispatch_queue_tenant WHERE tenant_ref = v_tenant FOR UPDATE;
        UPDATE agent_dispatch_queue_tenant_lane SET ready = ready + 1
         WHERE tenant_ref = v_tenant AND priority = v_prio;
        UPDATE agent_dispatch_queue_group_lane SET ready = ready + 1
         WHERE tenant_ref = v_tenant AND group_ref = v_group AND priority = v_prio;
        PERFORM pg_notify('agent_dispatch_queue', '');
    END IF;
    RETURN true;
END
$fn$;
