-- The WorkItem schema on SQLite, version 1: one section per statement (sqlite3 runs one at a
-- time inside the migration's transaction). Never edit a version that has shipped; add one.

-- name: counters
CREATE TABLE agent_dispatch_counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)

-- name: fencing_token
INSERT INTO agent_dispatch_counters (name, value) VALUES ('fencing_token', 0)

-- name: work_items
CREATE TABLE agent_dispatch_work_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL CHECK (tenant <> ''),
    kind TEXT NOT NULL,
    queue TEXT NOT NULL,
    session_id TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('submitted', 'ready', 'leased', 'running',
                                         'succeeded', 'failed', 'cancelled', 'dead_letter')),
    priority INTEGER NOT NULL,
    deadline REAL,
    attempt INTEGER NOT NULL CHECK (attempt >= 0 AND attempt <= max_attempts),
    max_attempts INTEGER NOT NULL CHECK (max_attempts >= 1),
    lease_epoch INTEGER NOT NULL,
    fencing_token INTEGER NOT NULL,
    lease_owner TEXT,
    lease_expires_at REAL,
    not_before REAL,
    idempotency_key TEXT,
    depends_on TEXT NOT NULL,
    pending_deps INTEGER NOT NULL,
    fairness_group TEXT,
    payload BLOB NOT NULL,
    payload_size INTEGER NOT NULL,
    payload_digest BLOB NOT NULL,
    outcome TEXT,
    error TEXT,
    commit_token INTEGER,
    last_dispatched_at REAL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    UNIQUE (tenant, idempotency_key)
)

-- name: claim_queue
-- The claim order (priority, then age) with the claimable states as the index predicate.
CREATE INDEX agent_dispatch_work_items_claim_queue ON agent_dispatch_work_items (queue, priority DESC, seq)
    WHERE state IN ('ready', 'leased', 'running')

-- name: claim_any
CREATE INDEX agent_dispatch_work_items_claim_any ON agent_dispatch_work_items (priority DESC, seq)
    WHERE state IN ('ready', 'leased', 'running')

-- name: leases
CREATE INDEX agent_dispatch_work_items_leases ON agent_dispatch_work_items (lease_expires_at)
    WHERE state IN ('leased', 'running')

-- name: dispatch
CREATE INDEX agent_dispatch_work_items_dispatch ON agent_dispatch_work_items (last_dispatched_at)
    WHERE state = 'ready'

-- name: deadline
CREATE INDEX agent_dispatch_work_items_deadline ON agent_dispatch_work_items (deadline)
    WHERE deadline IS NOT NULL AND state IN ('submitted', 'ready', 'leased', 'running')

-- name: tenant
CREATE INDEX agent_dispatch_work_items_tenant ON agent_dispatch_work_items (tenant, seq)

-- name: dependencies
CREATE TABLE agent_dispatch_dependencies (
    dependency TEXT NOT NULL,
    dependent TEXT NOT NULL,
    PRIMARY KEY (dependency, dependent)
) WITHOUT ROWID

-- name: outcomes
CREATE TABLE agent_dispatch_outcomes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    work_item_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    event TEXT NOT NULL,
    owner TEXT,
    lease_epoch INTEGER NOT NULL,
    fencing_token INTEGER NOT NULL,
    at REAL NOT NULL,
    outcome TEXT,
    detail TEXT
)

-- name: outcomes_item
CREATE INDEX agent_dispatch_outcomes_item ON agent_dispatch_outcomes (work_item_id, seq)

-- name: outcomes_no_update
-- Append-only in the database too, not just by convention in this code.
CREATE TRIGGER agent_dispatch_outcomes_no_update BEFORE UPDATE ON agent_dispatch_outcomes
    BEGIN SELECT RAISE(ABORT, 'outcome records are append-only'); END

-- name: outcomes_no_delete
CREATE TRIGGER agent_dispatch_outcomes_no_delete BEFORE DELETE ON agent_dispatch_outcomes
    BEGIN SELECT RAISE(ABORT, 'outcome records are append-only'); END
