"""PostgreSQL transport: ``agent_dispatch_queue`` with fair ``FOR UPDATE SKIP LOCKED`` claims.

``sql/`` holds the SQL (``queue.sql`` the tables and server-side functions, ``v<N>.sql`` the
in-place upgrades, ``queries.sql`` what Python runs); ``schema`` names it for the migration
runner, ``transport`` is the Python side, ``_parts`` its receipts and background threads.
"""

from __future__ import annotations

from agent_dispatch.transports.postgres._parts import _Claim
from agent_dispatch.transports.postgres.transport import DEFAULT_GROUP, PostgresTransport

__all__ = ["DEFAULT_GROUP", "PostgresTransport", "_Claim"]
