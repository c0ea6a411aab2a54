-- The PostgreSQL queue schema version 1, as agent-dispatch created it before version 2
-- (agent_dispatch/transports/_pg_schema.py at commit 673ddda): the upgrade test builds an old queue
-- from it. Kept verbatim; do not edit.
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
    served     bigint NOT NULL,
    queued     bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS agent_dispatch_queue_group (
    tenant_ref bytea NOT NULL,
    group_ref  bytea NOT NULL,
    served     bigint NOT NULL,
    queued     bigint NOT NULL,
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

-- Claim up to p_max rows for p_owner in the documented order. Returns the claimed rows.
CREATE OR REPLACE FUNCTION agent_dispatch_queue_claim(p_owner text, p_max integer, p_visibility interval)
RETURNS TABLE (id bigint, work_item_id text, wire bytea, claim_token uuid, claimed_at timestamptz,
               deliveries integer)
LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    v_id       bigint;
    v_tenant   bytea;
    v_group    bytea;
    v_prio     integer;
    v_seen     bigint;
    v_now      bigint;
    v_stamp    bigint;
    v_claimed  integer := 0;
    v_attempt  integer;
BEGIN
    -- The wake-up is a SQL function with data-modifying CTEs, planned afresh on every call (about
    -- half of an idle-path claim's cost): run it only when its index says something is due.
    IF EXISTS (SELECT 1 FROM agent_dispatch_queue WHERE state <> 'r' AND visible_at <= now()) THEN
        PERFORM agent_dispatch_queue_wake(256);
    END IF;
    WHILE v_claimed < p_max LOOP
        v_id := NULL;
        -- 1. Expired deadlines first, so their WorkItems are cancelled promptly. The set is
        --    empty in normal operation (one probe of the expiry index); when not, it is work
        --    that has to be drained anyway.
        SELECT q.id, q.tenant_ref, q.group_ref, q.priority
          INTO v_id, v_tenant, v_group, v_prio
          FROM agent_dispatch_queue q
          JOIN agent_dispatch_queue_tenant t ON t.tenant_ref = q.tenant_ref
          JOIN agent_dispatch_queue_group g ON g.tenant_ref = q.tenant_ref AND g.group_ref = q.group_ref
         WHERE q.state = 'r' AND q.deadline <= now()
         ORDER BY q.priority DESC, t.served, g.served, q.deadline, q.enqueued_at, q.id
         LIMIT 1
           FOR UPDATE OF q, t SKIP LOCKED;
        -- 2. Otherwise the best lane: highest priority, then least recently served tenant whose
        --    history row no concurrent claimer holds; then that tenant's least recently served
        --    group at that priority; then the lane's first row (deadline, enqueue time, id).
        v_attempt := 0;
        WHILE v_id IS NULL AND v_attempt < 4 LOOP
            v_attempt := v_attempt + 1;
            v_tenant := NULL;
            SELECT l.tenant_ref, l.priority, l.tenant_served
              INTO v_tenant, v_prio, v_seen
              FROM agent_dispatch_queue_tenant_lane l
              JOIN agent_dispatch_queue_tenant t ON t.tenant_ref = l.tenant_ref
             WHERE l.ready > 0
             ORDER BY l.priority DESC, l.tenant_served
             LIMIT 1
               FOR UPDATE OF t SKIP LOCKED;
            EXIT WHEN v_tenant IS NULL;
            -- The lane was read before the lock was granted: if a claimer committed in between,
            -- re-read it under the lock (a fresh statement sees the committed state).
            SELECT l.tenant_served INTO v_now
              FROM agent_dispatch_queue_tenant_lane l
             WHERE l.tenant_ref = v_tenant AND l.priority = v_prio AND l.ready > 0;
            CONTINUE WHEN v_now IS DISTINCT FROM v_seen;
            SELECT l.group_ref INTO v_group
              FROM agent_dispatch_queue_group_lane l
             WHERE l.tenant_ref = v_tenant AND l.priority = v_prio AND l.ready > 0
             ORDER BY l.group_served
             LIMIT 1;
            CONTINUE WHEN v_group IS NULL;
            SELECT q.id INTO v_id
              FROM agent_dispatch_queue q
             WHERE q.tenant_ref = v_tenant AND q.group_ref = v_group AND q.priority = v_prio
               AND q.state = 'r'
             ORDER BY q.deadline, q.enqueued_at, q.id
             LIMIT 1
               FOR UPDATE SKIP LOCKED;
        END LOOP;
        EXIT WHEN v_id IS NULL;

        v_stamp := nextval('agent_dispatch_queue_serve_seq');
        RETURN QUERY
            UPDATE agent_dispatch_queue q
               SET state = 'c', claim_owner = p_owner, claim_token = gen_random_uuid(),
                   claimed_at = clock_timestamp(), visible_at = now() + p_visibility,
                   deliveries = q.deliveries + 1
             WHERE q.id = v_id
            RETURNING q.id, q.work_item_id, q.wire, q.claim_token, q.claimed_at, q.deliveries;
        UPDATE agent_dispatch_queue_tenant SET served = v_stamp WHERE tenant_ref = v_tenant;
        UPDATE agent_dispatch_queue_group SET served = v_stamp
         WHERE tenant_ref = v_tenant AND group_ref = v_group;
        UPDATE agent_dispatch_queue_tenant_lane
           SET tenant_served = v_stamp, ready = ready - (priority = v_prio)::integer
         WHERE tenant_ref = v_tenant;
        UPDATE agent_dispatch_queue_group_lane
           SET group_served = v_stamp, ready = ready - (priority = v_prio)::integer
         WHERE tenant_ref = v_tenant AND group_ref = v_group;
        v_claimed := v_claimed + 1;
    END LOOP;
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
    v_depth   bigint;
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
    -- Tenant history rows in tenant_ref order (the lock order), created for newcomers.
    INSERT INTO agent_dispatch_queue_tenant AS t (tenant_ref, served, queued)
    SELECT u.t, c_new_base + nextval('agent_dispatch_queue_serve_seq'), count(*)
      FROM unnest(a_tenants) AS u(t)
     GROUP BY u.t
     ORDER BY u.t
    ON CONFLICT (tenant_ref) DO UPDATE SET queued = t.queued + excluded.queued;
    INSERT INTO agent_dispatch_queue_group AS g (tenant_ref, group_ref, served, queued)
    SELECT u.t, u.g, c_new_base + nextval('agent_dispatch_queue_serve_seq'), count(*)
      FROM unnest(a_tenants, a_groups) AS u(t, g)
     GROUP BY u.t, u.g
     ORDER BY u.t, u.g
    ON CONFLICT (tenant_ref, group_ref) DO UPDATE SET queued = g.queued + excluded.queued;
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
    -- Compare-and-admit on the counter row, last in the lock order: O(1), never COUNT(*).
    IF p_bound IS NULL THEN
        UPDATE agent_dispatch_queue_depth SET depth = depth + v_n;
    ELSE
        UPDATE agent_dispatch_queue_depth SET depth = depth + v_n WHERE depth + v_n <= p_bound
        RETURNING depth INTO v_depth;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'queue depth would exceed %', p_bound USING ERRCODE = 'AD001';
        END IF;
    END IF;
    IF 1 = ANY(a_ready) THEN
        PERFORM pg_notify('agent_dispatch_queue', '');
    END IF;
    RETURN v_n;
END
$fn$;

-- Acknowledge (delete) claimed rows whose receipt still matches: owner, token and claim time.
-- Returns the ids removed; a receipt not among them was stale or foreign.
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
    PERFORM 1 FROM agent_dispatch_queue_tenant
      WHERE tenant_ref = ANY(a_tenants) ORDER BY tenant_ref FOR UPDATE;
    UPDATE agent_dispatch_queue_tenant t SET queued = t.queued - c.n
      FROM (SELECT u.t, count(*) AS n FROM unnest(a_tenants) AS u(t) GROUP BY u.t) c
     WHERE t.tenant_ref = c.t;
    UPDATE agent_dispatch_queue_group g SET queued = g.queued - c.n
      FROM (SELECT u.t, u.g, count(*) AS n FROM unnest(a_tenants, a_groups) AS u(t, g) GROUP BY u.t, u.g) c
     WHERE g.tenant_ref = c.t AND g.group_ref = c.g;
    -- Fairness history is kept only while its tenant/group has queued work.
    WITH gone AS (
        DELETE FROM agent_dispatch_queue_group g
         WHERE g.tenant_ref = ANY(a_tenants) AND g.group_ref = ANY(a_groups) AND g.queued <= 0
        RETURNING g.tenant_ref, g.group_ref
    )
    DELETE FROM agent_dispatch_queue_group_lane l
     USING gone WHERE l.tenant_ref = gone.tenant_ref AND l.group_ref = gone.group_ref;
    WITH gone AS (
        DELETE FROM agent_dispatch_queue_tenant t
         WHERE t.tenant_ref = ANY(a_tenants) AND t.queued <= 0
        RETURNING t.tenant_ref
    )
    DELETE FROM agent_dispatch_queue_tenant_lane l USING gone WHERE l.tenant_ref = gone.tenant_ref;
    UPDATE agent_dispatch_queue_depth SET depth = depth - cardinality(a_ids);
    RETURN QUERY SELECT unnest(a_ids);
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
