"""The one migration runner: every component's schema (the WorkItem stores, the queues) is
versioned, checked and upgraded here, on PostgreSQL and SQLite alike.

A :class:`Schema` is numbered steps (``steps[v]`` takes version ``v - 1`` to ``v``) and, for a
component that re-asserts its current shape on every start, ``ensure`` statements (idempotent:
``IF NOT EXISTS``, ``CREATE OR REPLACE FUNCTION``) run after the steps. Such a component creates
a fresh database with ``ensure`` alone, so its steps only upgrade databases that already exist.
Where the version is recorded is a :class:`VersionRecord`: normally one row per component and
version in ``agent_dispatch_schema_version``; the PostgreSQL queue shipped with a key in its own
meta table and keeps it there, so existing databases need nothing rewritten.

The caller runs :func:`apply` inside one write transaction (all or nothing); the runner takes the
schema's advisory lock first on PostgreSQL (SQLite's ``BEGIN IMMEDIATE`` already serialises).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from agent_dispatch.db import sql
from agent_dispatch.errors import SchemaOutdated

log = logging.getLogger(__name__)

_SQL: Final = sql.load(__package__ or "agent_dispatch.db", "versions.sql")


def first(row: Any) -> Any:
    """The first column of a row, whether the connection returns tuples or dicts."""
    if isinstance(row, Mapping):
        return next(iter(row.values()))
    return row[0]


class VersionRecord(Protocol):
    """Where a component's schema version is kept."""

    def create(self, conn: Any) -> None:
        """Create the place the version is kept, if missing."""

    def read(self, conn: Any) -> int:
        """The recorded version; 0 when there is none (a fresh database)."""

    def write(self, conn: Any, version: int) -> None:
        """Record ``version`` as applied."""


@dataclass(frozen=True)
class ComponentVersions:
    """One row per component and version applied, in ``agent_dispatch_schema_version``."""

    dialect: str  # "postgres" or "sqlite"
    component: str

    def create(self, conn: Any) -> None:
        conn.execute(_SQL[f"{self.dialect}_create"])

    def read(self, conn: Any) -> int:
        if not first(conn.execute(_SQL[f"{self.dialect}_exists"]).fetchone()):
            return 0
        return int(first(conn.execute(_SQL[f"{self.dialect}_read"], (self.component,)).fetchone()))

    def write(self, conn: Any, version: int) -> None:
        conn.execute(_SQL[f"{self.dialect}_write"], (self.component, version))


@dataclass(frozen=True)
class Schema:
    """A component's schema as this code knows it."""

    #: How messages name it, e.g. "the WorkItem schema in PostgreSQL".
    title: str
    version: int
    record: VersionRecord
    steps: Mapping[int, Sequence[str]] = field(default_factory=dict)
    ensure: Sequence[str] = ()
    #: PostgreSQL advisory lock that serialises concurrent runs (transaction-scoped).
    lock_key: int | None = None
    #: What to do about a database older than the code (see :func:`require`).
    hint: str = "upgrade it"


def require(conn: Any, schema: Schema) -> int:
    """The recorded version; ``SchemaOutdated`` if it is older than this code needs."""
    current = schema.record.read(conn)
    if current < schema.version:
        raise SchemaOutdated(
            f"{schema.title} is at version {current}; this code needs {schema.version}: {schema.hint}"
        )
    return current


def apply(conn: Any, schema: Schema) -> int:
    """Bring the schema to this code's version inside the caller's transaction; returns it.

    A database newer than the code is refused: its shape is unknown here.
    """
    if schema.lock_key is not None:
        conn.execute(_SQL["postgres_lock"], (schema.lock_key,))
    schema.record.create(conn)
    current = schema.record.read(conn)
    if current > schema.version:
        raise SchemaOutdated(
            f"{schema.title} is version {current}; this code knows {schema.version}: upgrade agent-dispatch"
        )
    # A fresh database gets the current shape from ``ensure`` directly, where there is one.
    start = schema.version if current == 0 and schema.ensure else current
    for version in range(start + 1, schema.version + 1):
        if version not in schema.steps:
            raise SchemaOutdated(
                f"{schema.title} is version {current}, which this code cannot upgrade to "
                f"{schema.version}: drain it and drop its tables, or upgrade through an "
                "intermediate agent-dispatch release"
            )
        if current:
            log.info("upgrading %s from version %d to %d", schema.title, version - 1, version)
        for statement in schema.steps[version]:
            conn.execute(statement)
        schema.record.write(conn, version)
    for statement in schema.ensure:
        conn.execute(statement)
    if start > current:
        schema.record.write(conn, schema.version)
    return schema.version
