"""Fixtures for the database transports (SQLite and PostgreSQL), opened directly with small settings."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent_dispatch.transport import Transport
from agent_dispatch.transports.postgres import PostgresTransport
from agent_dispatch.transports.sqlite import SqliteTransport

MakeQueue = Callable[..., Transport]

DATABASE_BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=DATABASE_BACKENDS)
def make_queue(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeQueue]:
    opened: list[Transport] = []
    dsn = request.getfixturevalue("postgres_dsn") if request.param == "postgres" else None

    def make(*, max_depth: int = 10_000, visibility_timeout_s: float = 120.0) -> Transport:
        queue: Transport
        if dsn is not None:
            queue = PostgresTransport(
                dsn, max_depth=max_depth, visibility_timeout_s=visibility_timeout_s, pool_max_size=20
            )
        else:
            queue = SqliteTransport(
                tmp_path / "agent-dispatch.sqlite3",
                max_depth=max_depth,
                visibility_timeout_s=visibility_timeout_s,
            )
        queue.ensure_ready()
        opened.append(queue)
        return queue

    yield make
    for queue in opened:
        queue.close()
