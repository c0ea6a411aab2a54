-- The table every component records its schema versions in (one row per component and version
-- applied), in each dialect. Read by agent_dispatch.db.migrate.

-- name: postgres_exists
SELECT to_regclass('agent_dispatch_schema_version') IS NOT NULL AS present

-- name: postgres_create
CREATE TABLE IF NOT EXISTS agent_dispatch_schema_version (
    component text NOT NULL,
    version integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (component, version)
)

-- name: postgres_read
SELECT coalesce(max(version), 0) AS v FROM agent_dispatch_schema_version WHERE component = %s

-- name: postgres_write
INSERT INTO agent_dispatch_schema_version (component, version) VALUES (%s, %s)

-- name: postgres_lock
SELECT pg_advisory_xact_lock(%s)

-- name: sqlite_exists
SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'agent_dispatch_schema_version'

-- name: sqlite_create
CREATE TABLE IF NOT EXISTS agent_dispatch_schema_version (
    component TEXT NOT NULL,
    version INTEGER NOT NULL,
    applied_at REAL NOT NULL,
    PRIMARY KEY (component, version)
)

-- name: sqlite_read
SELECT coalesce(max(version), 0) FROM agent_dispatch_schema_version WHERE component = ?

-- name: sqlite_write
INSERT INTO agent_dispatch_schema_version (component, version, applied_at)
VALUES (?, ?, (julianday('now') - 2440587.5) * 86400.0)
