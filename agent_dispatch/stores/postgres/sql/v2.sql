-- 1 -> 2: an O(1) count of the unfinished WorkItems (submitted, ready, leased, running), the
-- admission authority when the queue lives outside this database (Kafka). Run as one script in
-- the migration's transaction. Never edit a version that has shipped; add v3.sql.
--
-- Kept by the database itself (triggers), so every statement that moves an item across the
-- unfinished/finished line counts, whoever writes it. The triggers are DEFERRED constraint
-- triggers: the counter row is written at COMMIT, after every other lock the transaction takes
-- (item rows, the queue's counters), so it is always the last lock taken and adds no deadlock
-- cycle; and it is held only for the commit itself. A bounded submit locks the row explicitly
-- (SELECT ... FOR UPDATE, also last) to compare before it commits.

CREATE TABLE agent_dispatch_unfinished (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    n bigint NOT NULL CHECK (n >= 0)
);

-- Writers wait while the count is taken, so the triggers see every change after it.
LOCK TABLE agent_dispatch_work_items IN SHARE ROW EXCLUSIVE MODE;
INSERT INTO agent_dispatch_unfinished (singleton, n)
    SELECT true, count(*) FROM agent_dispatch_work_items
     WHERE state IN ('submitted', 'ready', 'leased', 'running');

CREATE FUNCTION agent_dispatch_count_unfinished() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- The WHEN clauses below fire this only when a row enters or leaves the unfinished states.
    UPDATE agent_dispatch_unfinished
       SET n = n + CASE WHEN TG_OP <> 'DELETE' AND NEW.state IN ('submitted', 'ready', 'leased', 'running')
                        THEN 1 ELSE -1 END;
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER agent_dispatch_unfinished_insert
    AFTER INSERT ON agent_dispatch_work_items DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (NEW.state IN ('submitted', 'ready', 'leased', 'running'))
    EXECUTE FUNCTION agent_dispatch_count_unfinished();

CREATE CONSTRAINT TRIGGER agent_dispatch_unfinished_update
    AFTER UPDATE OF state ON agent_dispatch_work_items DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN ((OLD.state IN ('submitted', 'ready', 'leased', 'running'))
          IS DISTINCT FROM (NEW.state IN ('submitted', 'ready', 'leased', 'running')))
    EXECUTE FUNCTION agent_dispatch_count_unfinished();

-- Items are never deleted today; if a retention job ever does, the count stays right.
CREATE CONSTRAINT TRIGGER agent_dispatch_unfinished_delete
    AFTER DELETE ON agent_dispatch_work_items DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (OLD.state IN ('submitted', 'ready', 'leased', 'running'))
    EXECUTE FUNCTION agent_dispatch_count_unfinished();
