"""The PostgreSQL WorkItem store: the production authority (``STATE_DB_URI``).

``sql/`` holds the SQL (``v<N>.sql`` the migrations, ``statements.sql`` every statement);
``statements`` renders it, ``_base`` is the plumbing (pool, retries, schema, reads, leader
election), ``_submit`` and ``store`` the transitions. How the statements stay correct under
concurrency is told in :mod:`agent_dispatch.stores.postgres.store`.
"""

from __future__ import annotations

from agent_dispatch.stores.postgres._base import SCHEMA
from agent_dispatch.stores.postgres.statements import (
    CLAIM_NEXT,
    COMMIT_FAST,
    COMMIT_MANY,
    START_MANY,
    START_ONE,
    T,
)
from agent_dispatch.stores.postgres.store import PostgresStore

__all__ = [
    "CLAIM_NEXT",
    "COMMIT_FAST",
    "COMMIT_MANY",
    "SCHEMA",
    "START_MANY",
    "START_ONE",
    "PostgresStore",
    "T",
]
