-- 1 -> 2: the ``queued`` counters move out of the tenant and group history (which claims lock)
-- into ``agent_dispatch_queue_count``, counted afresh from the queue. The tables are locked for
-- its duration, so no claim or ack sees half of it.
LOCK TABLE agent_dispatch_queue, agent_dispatch_queue_tenant, agent_dispatch_queue_group,
           agent_dispatch_queue_tenant_lane, agent_dispatch_queue_group_lane, agent_dispatch_queue_depth
    IN ACCESS EXCLUSIVE MODE;
CREATE TABLE agent_dispatch_queue_count (
    tenant_ref bytea NOT NULL,
    group_ref  bytea NOT NULL,
    queued     bigint NOT NULL CHECK (queued >= 0),
    PRIMARY KEY (tenant_ref, group_ref)
);
INSERT INTO agent_dispatch_queue_count (tenant_ref, group_ref, queued)
SELECT k.tenant_ref, k.group_ref, count(q.id)
  FROM (SELECT tenant_ref, group_ref FROM agent_dispatch_queue_group
        UNION
        SELECT tenant_ref, group_ref FROM agent_dispatch_queue) k
  LEFT JOIN agent_dispatch_queue q ON q.tenant_ref = k.tenant_ref AND q.group_ref = k.group_ref
 GROUP BY k.tenant_ref, k.group_ref;
ALTER TABLE agent_dispatch_queue_tenant DROP COLUMN queued;
ALTER TABLE agent_dispatch_queue_group DROP COLUMN queued;
