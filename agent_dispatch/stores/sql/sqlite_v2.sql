-- The WorkItem schema on SQLite, 1 -> 2: an O(1) count of the unfinished WorkItems (submitted,
-- ready, leased, running), the admission authority when the queue lives outside this file (Kafka).
-- Kept by triggers, so every write that moves an item across the unfinished/finished line counts.
-- (SQLite has one writer at a time: no lock order to mind, unlike PostgreSQL's v2.sql.)

-- name: unfinished
INSERT INTO agent_dispatch_counters (name, value)
    SELECT 'unfinished', count(*) FROM agent_dispatch_work_items
     WHERE state IN ('submitted', 'ready', 'leased', 'running')

-- name: unfinished_insert
CREATE TRIGGER agent_dispatch_unfinished_insert AFTER INSERT ON agent_dispatch_work_items
    WHEN NEW.state IN ('submitted', 'ready', 'leased', 'running')
    BEGIN UPDATE agent_dispatch_counters SET value = value + 1 WHERE name = 'unfinished'; END

-- name: unfinished_update
CREATE TRIGGER agent_dispatch_unfinished_update AFTER UPDATE OF state ON agent_dispatch_work_items
    WHEN (OLD.state IN ('submitted', 'ready', 'leased', 'running'))
         IS NOT (NEW.state IN ('submitted', 'ready', 'leased', 'running'))
    BEGIN
        UPDATE agent_dispatch_counters
           SET value = value + CASE WHEN NEW.state IN ('submitted', 'ready', 'leased', 'running')
                                    THEN 1 ELSE -1 END
         WHERE name = 'unfinished';
    END

-- name: unfinished_delete
-- Items are never deleted today; if a retention job ever does, the count stays right.
CREATE TRIGGER agent_dispatch_unfinished_delete AFTER DELETE ON agent_dispatch_work_items
    WHEN OLD.state IN ('submitted', 'ready', 'leased', 'running')
    BEGIN UPDATE agent_dispatch_counters SET value = value - 1 WHERE name = 'unfinished'; END
