"""What the PostgreSQL queue's tests share."""

from __future__ import annotations

import psycopg

from agent_dispatch.transports.postgres import schema as _pg_schema


def reset_queue(dsn: str) -> None:
    """An empty queue: every queue and history table truncated, the depth counter at zero."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE " + ", ".join(_pg_schema.TABLES[:-1]))
        conn.execute("UPDATE agent_dispatch_queue_depth SET depth = 0")
