"""One way to open each WorkItemStore for tests, with a clock the test can move.

The in-memory store takes an injected clock. SQLite and PostgreSQL keep reading their own
database clock; tests move it with the stores' explicit test hook,
``set_clock_offset_for_tests(seconds)``, which adds a fixed interval to the database's now in
SQL. Every store a harness opens gets the same offset, so two stores agree on the time.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch.settings import Settings
from agent_dispatch.store import WorkItemStore
from agent_dispatch.stores.memory import MemoryStore
from agent_dispatch.stores.postgres import PostgresStore
from agent_dispatch.stores.sqlite import SqliteStore

BACKENDS = ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
DB_BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
START = 1_800_000_000.0  # a fixed instant for the fake clock (2027-01-15)


def store_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {"max_attempts": 3, "claim_ttl_s": 60, "max_payload_bytes": 1024}
    values.update(overrides)
    return Settings(**values)


class FakeClock:
    def __init__(self, start: float = START) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t


@dataclass
class Harness:
    backend: str
    settings: Settings
    opener: Callable[[], WorkItemStore]
    clock: FakeClock | None = None
    offset: float = 0.0
    opened: list[WorkItemStore] = field(default_factory=list)
    store: WorkItemStore = field(init=False)

    def __post_init__(self) -> None:
        self.store = self.open(migrate=True)

    def open(self, *, migrate: bool = False) -> WorkItemStore:
        """Another store on the same database (the memory backend has only one)."""
        if self.backend == "memory" and self.opened:
            return self.opened[0]
        store = self.opener()
        self.opened.append(store)
        self._apply_offset(store)
        if migrate:
            store.migrate()
        return store

    def advance(self, seconds: float) -> None:
        """Move the store clock forward (or back) by ``seconds``."""
        if self.clock is not None:
            self.clock.t += seconds
            return
        self.offset += seconds
        for store in self.opened:
            self._apply_offset(store)

    def _apply_offset(self, store: WorkItemStore) -> None:
        hook = getattr(store, "set_clock_offset_for_tests", None)
        if hook is not None:
            hook(self.offset)

    def close(self) -> None:
        for store in reversed(self.opened):
            with contextlib.suppress(Exception):
                store.close()
        self.opened.clear()


@pytest.fixture(scope="session")
def store_postgres_dsn(postgres_server: Any) -> Iterator[str]:
    """One migrated database shared by the store tests, emptied before each (creating a database
    per test costs far more than the tests themselves)."""
    name = f"store_{uuid.uuid4().hex[:12]}"
    dsn: str = postgres_server.create_database(name)
    store = PostgresStore(dsn, store_settings(), max_size=1)
    store.migrate()
    store.close()
    yield dsn
    postgres_server.drop_database(name)


def reset_postgres(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        # Row triggers keep outcomes append-only; TRUNCATE is the test reset, not an update.
        conn.execute(
            "TRUNCATE agent_dispatch_work_items, agent_dispatch_dependencies, agent_dispatch_outcomes"
        )
        # TRUNCATE fires no row triggers: the unfinished count (schema v2) starts again at zero.
        conn.execute("UPDATE agent_dispatch_unfinished SET n = 0")


@contextlib.contextmanager
def open_harness(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, settings: Settings | None = None
) -> Iterator[Harness]:
    settings = settings or store_settings()
    if backend == "memory":
        clock = FakeClock()
        harness = Harness(backend, settings, lambda: MemoryStore(settings, clock=clock), clock=clock)
    elif backend == "sqlite":
        path = tmp_path / "store.sqlite3"
        harness = Harness(backend, settings, lambda: SqliteStore(path, settings))
    elif backend == "postgres":
        dsn: str = request.getfixturevalue("store_postgres_dsn")
        reset_postgres(dsn)
        harness = Harness(backend, settings, lambda: PostgresStore(dsn, settings, max_size=4))
    else:  # pragma: no cover - a typo in a parametrisation
        raise ValueError(backend)
    try:
        yield harness
    finally:
        harness.close()
