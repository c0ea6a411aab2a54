-- The SQLite queue's current shape, asserted on every start (idempotent); version 1 of the
-- "queue" component. One section per statement: sqlite3 runs one at a time.

-- name: queue
CREATE TABLE IF NOT EXISTS agent_dispatch_queue (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    work_item_id TEXT NOT NULL UNIQUE,
    session_id TEXT NOT NULL,
    priority INTEGER NOT NULL,
    deadline_key REAL NOT NULL,
    enqueued_at REAL NOT NULL,
    visible_at REAL NOT NULL,
    claim_owner TEXT,
    claim_token TEXT,
    deliveries INTEGER NOT NULL DEFAULT 0,
    wire BLOB NOT NULL
)

-- name: queue_order
CREATE INDEX IF NOT EXISTS agent_dispatch_queue_order
    ON agent_dispatch_queue (priority DESC, deadline_key, enqueued_at, id)

-- name: queue_expiry
CREATE INDEX IF NOT EXISTS agent_dispatch_queue_expiry ON agent_dispatch_queue (deadline_key)

-- name: depth
CREATE TABLE IF NOT EXISTS agent_dispatch_queue_depth (
    singleton INTEGER PRIMARY KEY CHECK (singleton = 1),
    depth INTEGER NOT NULL CHECK (depth >= 0)
)

-- name: depth_row
INSERT OR IGNORE INTO agent_dispatch_queue_depth (singleton, depth) VALUES (1, 0)
