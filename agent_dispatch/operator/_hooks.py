"""The operator's two database duties on the PostgreSQL backend: migrations and queue depth.

Both go through the same store and transport code the workers run, so the operator never holds
a second copy of the schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HookResult:
    ran: bool
    detail: str
    value: Any = None


def _settings() -> Any:
    from agent_dispatch.settings import load

    # Only what the schema needs; the AgentDispatch spec's own limits are the workers' business.
    return load()


def run_migrations(dsn: str) -> HookResult:
    """Create or upgrade the WorkItem schema and the queue tables (idempotent)."""
    from agent_dispatch.stores.postgres import PostgresStore
    from agent_dispatch.transports.postgres import PostgresTransport

    settings = _settings()
    store = PostgresStore(dsn, settings, max_size=1)
    try:
        version = store.migrate()
    finally:
        store.close()
    transport = PostgresTransport(dsn, max_depth=settings.max_depth, visibility_timeout_s=60, pool_max_size=1)
    try:
        transport.ensure_ready()
    finally:
        transport.close()
    return HookResult(True, f"WorkItem schema at version {version}; queue tables present", version)


def queue_depth(dsn: str) -> HookResult:
    """Accepted, unacknowledged turns from the queue's admission counter."""
    from agent_dispatch.transports.postgres import PostgresTransport

    transport = PostgresTransport(dsn, max_depth=1, visibility_timeout_s=60, pool_max_size=1)
    try:
        return HookResult(True, "ok", transport.depth())
    finally:
        transport.close()


#: Set by the Helm chart on the operator's container: the worker ServiceAccount of the release,
#: used when an AgentDispatch names none (so no manifest hard-codes a release's name).
WORKER_SERVICE_ACCOUNT_ENV = "AGENT_DISPATCH_WORKER_SERVICE_ACCOUNT"


def default_worker_service_account() -> str | None:
    import os

    return os.environ.get(WORKER_SERVICE_ACCOUNT_ENV) or None


def depth_query() -> str:
    """The KEDA postgresql trigger's query."""
    from agent_dispatch.operator._desired import DEFAULT_DEPTH_QUERY

    return DEFAULT_DEPTH_QUERY
