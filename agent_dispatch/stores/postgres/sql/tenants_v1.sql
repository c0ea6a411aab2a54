-- The per-tenant counters the web UI's tenants page reads (component "work_items_tenants",
-- version 1), run as one script in the migration's transaction by
-- agent_dispatch.stores.postgres._inspect. Never edit a version that has shipped; add tenants_v2.sql.
--
-- Why a ledger and not one row per tenant: the row triggers below run inside the hot
-- transitions (submit, claim, commit). Updating one counter row per tenant would make every
-- worker of a tenant wait for the others' commits, and a batch over several tenants could
-- deadlock with another batch (or with an item row lock taken later in the same transaction).
-- Appending a delta row takes no lock anyone else waits for. agent_dispatch_tenant_fold (called
-- by the gateway every few seconds) folds each tenant's deltas into one row; a reader sums the
-- rows of the tenants it shows (one row each, plus the deltas since the last fold).

CREATE TABLE agent_dispatch_tenant_counts (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant    text NOT NULL,
    queued    bigint NOT NULL,   -- submitted (waiting on dependencies) and ready
    running   bigint NOT NULL,   -- leased and running
    done      bigint NOT NULL,   -- succeeded, failed, cancelled, dead_letter
    served_at timestamptz        -- the newest claim (queued -> running) among the rows summed
);
-- Per tenant: the reader's sum and the tenant list's skip scan (one descent per tenant listed).
CREATE INDEX agent_dispatch_tenant_counts_tenant ON agent_dispatch_tenant_counts (tenant);

-- The oldest waiting item of a tenant is the first entry of its part of this index.
CREATE INDEX agent_dispatch_work_items_waiting ON agent_dispatch_work_items (tenant, seq)
    WHERE state IN ('submitted', 'ready');

-- Writers wait while the counts are taken, so the triggers see every change after them.
LOCK TABLE agent_dispatch_work_items IN SHARE ROW EXCLUSIVE MODE;
INSERT INTO agent_dispatch_tenant_counts (tenant, queued, running, done)
SELECT tenant,
       count(*) FILTER (WHERE state IN ('submitted', 'ready')),
       count(*) FILTER (WHERE state IN ('leased', 'running')),
       count(*) FILTER (WHERE state IN ('succeeded', 'failed', 'cancelled', 'dead_letter'))
  FROM agent_dispatch_work_items
 GROUP BY tenant;

-- One statement-level trigger per kind of write: a batch (insert_many, commit_many) appends one
-- delta per tenant, not one per item; a statement that moves no item between the three buckets
-- (lease renewals, dispatch stamps, leased -> running) appends nothing.
CREATE FUNCTION agent_dispatch_tenant_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO agent_dispatch_tenant_counts (tenant, queued, running, done)
        SELECT tenant,
               count(*) FILTER (WHERE state IN ('submitted', 'ready')),
               count(*) FILTER (WHERE state IN ('leased', 'running')),
               count(*) FILTER (WHERE state NOT IN ('submitted', 'ready', 'leased', 'running'))
          FROM new_rows GROUP BY tenant;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO agent_dispatch_tenant_counts (tenant, queued, running, done)
        SELECT tenant,
               -count(*) FILTER (WHERE state IN ('submitted', 'ready')),
               -count(*) FILTER (WHERE state IN ('leased', 'running')),
               -count(*) FILTER (WHERE state NOT IN ('submitted', 'ready', 'leased', 'running'))
          FROM old_rows GROUP BY tenant;
    ELSE
        INSERT INTO agent_dispatch_tenant_counts (tenant, queued, running, done, served_at)
        SELECT d.tenant, sum(d.q), sum(d.r), sum(d.d), max(d.served_at)
          FROM (SELECT n.tenant,
                       (n.state IN ('submitted', 'ready'))::int - (o.state IN ('submitted', 'ready'))::int AS q,
                       (n.state IN ('leased', 'running'))::int - (o.state IN ('leased', 'running'))::int AS r,
                       (n.state NOT IN ('submitted', 'ready', 'leased', 'running'))::int
                         - (o.state NOT IN ('submitted', 'ready', 'leased', 'running'))::int AS d,
                       CASE WHEN o.state IN ('submitted', 'ready') AND n.state IN ('leased', 'running')
                            THEN n.updated_at END AS served_at
                  FROM new_rows n JOIN old_rows o ON o.id = n.id
                 WHERE n.state <> o.state) d
         GROUP BY d.tenant
        HAVING sum(abs(d.q)) + sum(abs(d.r)) + sum(abs(d.d)) > 0;
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER agent_dispatch_tenant_count_insert AFTER INSERT ON agent_dispatch_work_items
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION agent_dispatch_tenant_count();
CREATE TRIGGER agent_dispatch_tenant_count_update AFTER UPDATE ON agent_dispatch_work_items
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION agent_dispatch_tenant_count();
CREATE TRIGGER agent_dispatch_tenant_count_delete AFTER DELETE ON agent_dispatch_work_items
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION agent_dispatch_tenant_count();

-- TRUNCATE (the tests' reset) fires no row trigger: the counts go with the items.
CREATE FUNCTION agent_dispatch_tenant_count_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE agent_dispatch_tenant_counts;
    RETURN NULL;
END $$;
CREATE TRIGGER agent_dispatch_tenant_count_truncate AFTER TRUNCATE ON agent_dispatch_work_items
    FOR EACH STATEMENT EXECUTE FUNCTION agent_dispatch_tenant_count_truncate();

-- Fold every tenant that has deltas into one row per tenant, at most p_limit tenants per call;
-- returns the tenants folded. One folder at a time (a second caller returns 0 at once); a delta
-- committed after the fold's snapshot is left for the next fold, so no change is lost or counted
-- twice, and a reader sees either the rows before the fold or the row after it.
CREATE FUNCTION agent_dispatch_tenant_fold(p_limit integer) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_n integer;
BEGIN
    IF NOT pg_try_advisory_xact_lock(7233174400395771905) THEN
        RETURN 0;
    END IF;
    WITH busy AS (
        SELECT tenant FROM agent_dispatch_tenant_counts GROUP BY tenant HAVING count(*) > 1 LIMIT p_limit
    ), gone AS (
        DELETE FROM agent_dispatch_tenant_counts c USING busy WHERE c.tenant = busy.tenant
        RETURNING c.tenant, c.queued, c.running, c.done, c.served_at
    ), folded AS (
        INSERT INTO agent_dispatch_tenant_counts (tenant, queued, running, done, served_at)
        SELECT tenant, sum(queued), sum(running), sum(done), max(served_at) FROM gone GROUP BY tenant
        RETURNING 1
    )
    SELECT count(*) INTO v_n FROM folded;
    RETURN v_n;
END $$;
