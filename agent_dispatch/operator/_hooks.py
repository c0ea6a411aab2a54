"""Integration points the WorkItem store fills in later: schema migrations and queue depth.

The operator does not know the schema and must not invent one, so it calls the store only if
``agent_dispatch.store`` exists and exports the function. Until then these are no-ops that say
so, and the doctor report shows it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HookResult:
    ran: bool
    detail: str
    value: Any = None


def _store_function(name: str) -> Callable[..., Any] | None:
    try:
        store = importlib.import_module("agent_dispatch.store")
    except ModuleNotFoundError as exc:
        if exc.name not in {"agent_dispatch.store", "agent_dispatch"}:
            raise  # the store exists but one of its own imports is broken: surface it
        return None
    function = getattr(store, name, None)
    return function if callable(function) else None


def run_migrations(dsn: str) -> HookResult:
    """Create or upgrade the WorkItem and queue schema through ``agent_dispatch.store.migrate``."""
    migrate = _store_function("migrate")
    if migrate is None:
        return HookResult(False, "the WorkItem store provides no migrate() in this build")
    value = migrate(dsn)
    return HookResult(True, "migrations applied", value)


def queue_depth(dsn: str) -> HookResult:
    """Queue depth from ``agent_dispatch.store.queue_depth`` (PostgreSQL backend), if provided."""
    depth = _store_function("queue_depth")
    if depth is None:
        return HookResult(False, "the WorkItem store provides no queue_depth() in this build")
    return HookResult(True, "ok", depth(dsn))


def depth_query() -> str | None:
    """The store's own SQL for queue depth (used by a KEDA postgresql trigger), if it exports one."""
    try:
        store = importlib.import_module("agent_dispatch.store")
    except ModuleNotFoundError:
        return None
    query = getattr(store, "DEPTH_QUERY", None)
    return query if isinstance(query, str) else None
