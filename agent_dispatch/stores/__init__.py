"""WorkItemStore implementations (the Protocol lives in :mod:`agent_dispatch.store`).

``postgres`` is the production authority (``STATE_DB_URI``), ``sqlite`` the local default;
``memory`` exists for unit tests and is deliberately not selectable by settings.
"""

from __future__ import annotations

from agent_dispatch.settings import Settings
from agent_dispatch.store import WorkItemStore


def open_store(settings: Settings) -> WorkItemStore:
    """The store the settings call for: PostgreSQL when ``STATE_DB_URI`` is set, else SQLite.

    Opening does not migrate; a store refuses to work on an older schema (``SchemaOutdated``)
    until ``agent-dispatch migrate`` has run.
    """
    if settings.state_db_uri is not None:
        from agent_dispatch.stores.postgres import PostgresStore

        return PostgresStore(settings.state_db_uri.get_secret_value(), settings)
    from agent_dispatch.stores.sqlite import SqliteStore

    return SqliteStore(settings.sqlite_path, settings)


__all__ = ["open_store"]
