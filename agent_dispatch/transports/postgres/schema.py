"""The PostgreSQL queue's schema (``agent_dispatch_queue``): the SQL is in ``sql/queue.sql``.

Why server-side functions: a claim is several dependent steps (pick a lane, lock its tenant,
pick the lane's best row, stamp the fairness history, move the counters) and running them in
one PL/pgSQL call costs one round trip and keeps every step inside one short transaction.

Shape of the data (each claim touches O(1) rows through indexes, whatever the backlog):

- ``agent_dispatch_queue``: one row per queued delivery, ``state`` ``r`` (ready), ``c`` (claimed,
  invisible until ``visible_at``) or ``d`` (delayed until ``visible_at``). At most one row per
  WorkItem, so a re-drive never duplicates a delivery that still exists.
- ``agent_dispatch_queue_tenant`` / ``_group``: the fairness history. ``served`` is a stamp from one
  sequence, unique, so "least recently served" never ties. A tenant or group first seen gets a
  stamp far below every served one (never served = most deserving; newcomers in arrival order).
- ``agent_dispatch_queue_tenant_lane`` (priority, tenant) and ``_group_lane`` (priority, tenant,
  group): ``ready`` counts visible rows and a copy of the served stamp, so a partial index on
  ``(priority DESC, tenant_served) WHERE ready > 0`` yields the next lane in one index probe,
  instead of a sort or window function over the backlog.
- ``agent_dispatch_queue_count`` (tenant, group): ``queued`` counts all its rows, whatever their
  state. Kept apart from the history so that acknowledgements, which only decrement it, never
  wait for the tenant locks that claims hold. History whose counters are all at zero is removed
  by ``agent_dispatch_queue_prune`` (called periodically by the transport), not by the ack: a
  tenant that runs dry and gets work again between two prunes keeps its history and its rows.
- ``agent_dispatch_queue_depth``: the admission counter (compare-and-admit, never ``COUNT(*)``).

Lock order (deadlock freedom): queue rows, then tenant rows in ``tenant_ref`` order, then
counter rows in (``tenant_ref``, ``group_ref``) order, then the depth counter. A claim never waits
for a tenant: it locks it with SKIP LOCKED, and everything else it touches (group history, lanes)
is only written under that tenant's lock. Admissions lock their tenants' rows too (so a prune
cannot remove history their rows need); acknowledgements take only counter rows and the depth
counter; the prune takes tenant and counter rows with SKIP LOCKED and never waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from agent_dispatch.db import sql
from agent_dispatch.db.migrate import Schema

_PACKAGE: Final = __package__ or "agent_dispatch.transports.postgres"
QUERIES: Final = sql.load(_PACKAGE, "sql/queries.sql")

SCHEMA_VERSION: Final = 2
NOTIFY_CHANNEL: Final = "agent_dispatch_queue"
#: SQLSTATE our admit function raises when the batch would pass the bound.
QUEUE_FULL_SQLSTATE: Final = "AD001"
#: SQLSTATE it raises when the depth counter row is gone: the depth is unknown.
DEPTH_MISSING_SQLSTATE: Final = "AD002"

#: Tables in dependency order (tests truncate them between examples).
TABLES: Final = (
    "agent_dispatch_queue",
    "agent_dispatch_queue_tenant",
    "agent_dispatch_queue_group",
    "agent_dispatch_queue_tenant_lane",
    "agent_dispatch_queue_group_lane",
    "agent_dispatch_queue_count",
    "agent_dispatch_queue_depth",
)
#: The fairness history and its counters: what the prune removes once no row needs it.
HISTORY_TABLES: Final = TABLES[1:-1]


@dataclass(frozen=True)
class MetaVersion:
    """The queue's version, kept (since version 1) under a key of ``agent_dispatch_queue_meta``."""

    def create(self, conn: Any) -> None:
        conn.execute(QUERIES["meta_create"])

    def read(self, conn: Any) -> int:
        row = conn.execute(QUERIES["meta_version"]).fetchone()
        return 0 if row is None else int(bytes(row[0]))

    def write(self, conn: Any, version: int) -> None:
        conn.execute(QUERIES["meta_set_version"], (str(version).encode(),))


#: Created whole by ``queue.sql`` (which also replaces every function on each start); ``v<N>.sql``
#: upgrades an existing version N-1 queue in place, in ``ensure_ready``'s transaction.
SCHEMA: Final = Schema(
    title="the queue schema",
    version=SCHEMA_VERSION,
    record=MetaVersion(),
    steps={2: (sql.read(_PACKAGE, "sql/v2.sql"),)},
    ensure=(sql.read(_PACKAGE, "sql/queue.sql"),),
    # Serialises concurrent ``ensure_ready`` calls (CREATE OR REPLACE FUNCTION races otherwise).
    lock_key=0x41445F5155455545,  # "AD_QUEUE"
)
