-- The PostgreSQL queue's statements run from Python (the claim, admit, ack, release and prune
-- logic itself is in the functions of queue.sql).

-- name: meta_create
CREATE TABLE IF NOT EXISTS agent_dispatch_queue_meta (key text PRIMARY KEY, value bytea NOT NULL)

-- name: meta_version
SELECT value FROM agent_dispatch_queue_meta WHERE key = 'schema_version'

-- name: meta_set_version
INSERT INTO agent_dispatch_queue_meta VALUES ('schema_version', %s)
ON CONFLICT (key) DO UPDATE SET value = excluded.value

-- name: meta_salt
-- The salt is made once per database; every later start reads the same one.
INSERT INTO agent_dispatch_queue_meta VALUES ('ref_salt', %s) ON CONFLICT (key) DO NOTHING

-- name: meta_read_salt
SELECT value FROM agent_dispatch_queue_meta WHERE key = 'ref_salt'

-- name: admit
SELECT agent_dispatch_queue_admit(%b::text[], %b::text[], %b::bytea[], %b::bytea[], %b::integer[], %b::timestamptz[], %b::timestamptz[], %b::bytea[], %s::bigint)

-- name: admit_one
SELECT agent_dispatch_queue_admit_one(%s::text, %s::text, %s::bytea, %s::bytea, %s::integer, %s::timestamptz, %s::timestamptz, %s::bytea, %s::bigint)

-- name: depth
SELECT depth FROM agent_dispatch_queue_depth

-- name: claim
SELECT id, work_item_id, wire, claim_token, claimed_at, deliveries FROM agent_dispatch_queue_claim(%s, %s, make_interval(secs => %s))

-- name: prune
SELECT agent_dispatch_queue_prune(%s)

-- name: ack
SELECT agent_dispatch_queue_ack(%b::bigint[], %b::text[], %b::uuid[], %b::timestamptz[])

-- name: release
SELECT agent_dispatch_queue_release(%s, %s, %s, %s, make_interval(secs => %s))

-- name: dead_rows
SELECT relname::text, n_dead_tup, n_live_tup FROM pg_stat_user_tables WHERE relid = ANY(%s::regclass[])

-- name: owns_tables
-- Whether VACUUM would process the queue's tables rather than skip them with a warning.
SELECT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) OR pg_has_role((SELECT datdba FROM pg_database WHERE datname = current_database()), 'USAGE') OR bool_and(pg_has_role(c.relowner, 'USAGE')) FROM pg_class c WHERE c.oid = ANY(%s::regclass[])
