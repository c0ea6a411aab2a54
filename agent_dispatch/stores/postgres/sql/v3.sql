-- 2 -> 3: the unfinished count (v2.sql) moves once per transaction instead of once per row. Run
-- as one script in the migration's transaction. Never edit a version that has shipped; add v4.sql.
--
-- In v2 each row entering or leaving the unfinished states ran one UPDATE of the counter row at
-- COMMIT: a batch of 100 submits wrote the row 100 times, each a new version of the same row, and
-- end to end those updates were the second largest item of the server's statement time
-- (bench/findings.md, issue 21). Now an ordinary AFTER ROW trigger (the same WHEN clauses) adds
-- each row's +1 or -1 to a transaction-local setting, which costs no write; the deferred
-- constraint triggers of v2 stay, and the first of them to fire at COMMIT applies the sum with
-- one UPDATE and zeroes it, so the rest find nothing to do. The counter row is still written at
-- COMMIT only, after every other lock: still the last lock taken, held only for the commit.
--
-- Why it stays exact: every row change queues both events; the AFTER ROW ones fire when their
-- statement ends, so every +/-1 is summed before COMMIT runs the deferred ones (SET CONSTRAINTS
-- ... IMMEDIATE applies what was summed so far; later changes queue deferred events of their
-- own). A setting made with is_local reverts with the (sub)transaction that made it, exactly as
-- the row changes it counted and their deferred events do.

-- Writers wait until the triggers are swapped, so no transaction straddles the two versions.
LOCK TABLE agent_dispatch_work_items IN SHARE ROW EXCLUSIVE MODE;

CREATE FUNCTION agent_dispatch_note_unfinished() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config(
        'agent_dispatch.unfinished_delta',
        (coalesce(nullif(current_setting('agent_dispatch.unfinished_delta', true), ''), '0')::bigint
         + CASE WHEN TG_OP <> 'DELETE' AND NEW.state IN ('submitted', 'ready', 'leased', 'running')
                THEN 1 ELSE -1 END)::text,
        true);
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION agent_dispatch_count_unfinished() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_delta bigint := coalesce(nullif(current_setting('agent_dispatch.unfinished_delta', true), ''), '0')::bigint;
BEGIN
    IF v_delta <> 0 THEN
        UPDATE agent_dispatch_unfinished SET n = n + v_delta;
        PERFORM set_config('agent_dispatch.unfinished_delta', '0', true);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER agent_dispatch_note_unfinished_insert
    AFTER INSERT ON agent_dispatch_work_items FOR EACH ROW
    WHEN (NEW.state IN ('submitted', 'ready', 'leased', 'running'))
    EXECUTE FUNCTION agent_dispatch_note_unfinished();

CREATE TRIGGER agent_dispatch_note_unfinished_update
    AFTER UPDATE OF state ON agent_dispatch_work_items FOR EACH ROW
    WHEN ((OLD.state IN ('submitted', 'ready', 'leased', 'running'))
          IS DISTINCT FROM (NEW.state IN ('submitted', 'ready', 'leased', 'running')))
    EXECUTE FUNCTION agent_dispatch_note_unfinished();

CREATE TRIGGER agent_dispatch_note_unfinished_delete
    AFTER DELETE ON agent_dispatch_work_items FOR EACH ROW
    WHEN (OLD.state IN ('submitted', 'ready', 'leased', 'running'))
    EXECUTE FUNCTION agent_dispatch_note_unfinished();
