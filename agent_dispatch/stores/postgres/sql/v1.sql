-- The WorkItem schema on PostgreSQL, version 1 (run as one script in the migration's
-- transaction). Never edit a version that has shipped; add v2.sql.

CREATE SEQUENCE agent_dispatch_fencing_token_seq AS bigint;

CREATE TABLE agent_dispatch_work_items (
    seq bigint GENERATED ALWAYS AS IDENTITY,
    id text PRIMARY KEY,
    tenant text NOT NULL CHECK (tenant <> ''),
    kind text NOT NULL,
    queue text NOT NULL,
    session_id text NOT NULL,
    state text NOT NULL CHECK (state IN ('submitted', 'ready', 'leased', 'running',
                                         'succeeded', 'failed', 'cancelled', 'dead_letter')),
    priority integer NOT NULL,
    deadline timestamptz,
    attempt integer NOT NULL CHECK (attempt >= 0 AND attempt <= max_attempts),
    max_attempts integer NOT NULL CHECK (max_attempts >= 1),
    lease_epoch bigint NOT NULL DEFAULT 0,
    fencing_token bigint NOT NULL DEFAULT 0,
    lease_owner text,
    lease_expires_at timestamptz,
    not_before timestamptz,
    idempotency_key text,
    depends_on text[] NOT NULL DEFAULT '{}',
    pending_deps integer NOT NULL DEFAULT 0,
    has_dependents boolean NOT NULL DEFAULT false,
    fairness_group text,
    payload bytea NOT NULL,
    payload_size integer NOT NULL,
    payload_digest bytea NOT NULL,
    outcome text,
    error text,
    commit_token bigint,
    last_dispatched_at timestamptz,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    UNIQUE (tenant, idempotency_key)
);
-- Exactly the claim's ORDER BY, over the claimable states only: the claim reads the head of this
-- index whatever the backlog (terminal rows are not in it at all).
CREATE INDEX agent_dispatch_work_items_claim_queue ON agent_dispatch_work_items (queue, priority DESC, seq)
    WHERE state IN ('ready', 'leased', 'running');
CREATE INDEX agent_dispatch_work_items_claim_any ON agent_dispatch_work_items (priority DESC, seq)
    WHERE state IN ('ready', 'leased', 'running');
CREATE INDEX agent_dispatch_work_items_leases ON agent_dispatch_work_items (lease_expires_at)
    WHERE state IN ('leased', 'running');
CREATE INDEX agent_dispatch_work_items_dispatch ON agent_dispatch_work_items (last_dispatched_at NULLS FIRST)
    WHERE state = 'ready';
CREATE INDEX agent_dispatch_work_items_deadline ON agent_dispatch_work_items (deadline)
    WHERE deadline IS NOT NULL AND state IN ('submitted', 'ready', 'leased', 'running');
CREATE INDEX agent_dispatch_work_items_tenant ON agent_dispatch_work_items (tenant, seq);

CREATE TABLE agent_dispatch_dependencies (
    dependency text NOT NULL,
    dependent text NOT NULL REFERENCES agent_dispatch_work_items (id),
    PRIMARY KEY (dependency, dependent)
);

CREATE TABLE agent_dispatch_outcomes (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    work_item_id text NOT NULL,
    tenant text NOT NULL,
    event text NOT NULL,
    owner text,
    lease_epoch bigint NOT NULL,
    fencing_token bigint NOT NULL,
    at timestamptz NOT NULL,
    outcome text,
    detail text
);
CREATE INDEX agent_dispatch_outcomes_item ON agent_dispatch_outcomes (work_item_id, seq);
-- Append-only in the database, not just by convention in this code.
CREATE FUNCTION agent_dispatch_outcomes_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN RAISE EXCEPTION 'outcome records are append-only'; END $$;
CREATE TRIGGER agent_dispatch_outcomes_append_only BEFORE UPDATE OR DELETE ON agent_dispatch_outcomes
    FOR EACH ROW EXECUTE FUNCTION agent_dispatch_outcomes_append_only();
