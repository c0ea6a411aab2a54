"""After a PostgreSQL restart no operation fails (issue 22; docs/reliability.md finding 8).

Every pool first holds several idle connections, the real server is restarted (gracefully, and
crash-like), and operations start the moment it accepts connections again: WorkItem store and
queue calls, one after another and from several threads at once, and the worker's session-lock
connections. Before the pools checked what they lend, each idle connection failed the one
operation that borrowed it next.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from agent_dispatch.dispatch import build_turn
from agent_dispatch.models import Outcome, SubmitRequest
from agent_dispatch.settings import Settings
from agent_dispatch.stores.postgres import PostgresStore
from agent_dispatch.transports.postgres import PostgresTransport
from agent_dispatch.worker import SessionLockConnections
from testenv.postgres import PostgresServer

pytestmark = pytest.mark.postgres

KEY = b"k" * 40
POOL = 4


@pytest.fixture
def parts(postgres_dsn: str) -> Iterator[tuple[PostgresStore, PostgresTransport, SessionLockConnections]]:
    # The test server runs with synchronous_commit off; a crash-like restart would then lose the
    # last commits (as on any server configured so). Production keeps the default, on.
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET synchronous_commit = on").format(sql.Identifier(conn.info.dbname))
        )
    store = PostgresStore(postgres_dsn, Settings(claim_ttl_s=30), max_size=POOL)
    store.migrate()
    transport = PostgresTransport(postgres_dsn, max_depth=1000, visibility_timeout_s=30, pool_max_size=POOL)
    transport.ensure_ready()
    sessions = SessionLockConnections(postgres_dsn, idle_timeout_s=60)
    try:
        yield store, transport, sessions
    finally:
        sessions.close()
        transport.close()
        store.close()


def fill(pool: Any) -> None:
    """Make the pool hold ``POOL`` idle connections (borrowed together, then all given back)."""
    with contextlib.ExitStack() as stack:
        for _ in range(POOL):
            stack.enter_context(pool.connection())
    assert pool.get_stats()["pool_available"] == POOL


def one_turn(
    store: PostgresStore, transport: PostgresTransport, sessions: SessionLockConnections, n: str
) -> None:
    """Every kind of call a gateway and a worker make for one turn."""
    item = store.submit(SubmitRequest(tenant="acme", kind="turn", payload=b"{}", idempotency_key=n)).item
    transport.admit([build_turn(item, signing_key=KEY)])
    assert transport.depth() >= 1
    deliveries = transport.claim(f"w-{n}", max_items=1, wait_s=10)  # any turn: threads race
    assert deliveries
    lease = store.claim(f"w-{n}", work_item_id=deliveries[0].work_item_id)
    assert lease is not None
    lease = store.mark_running(lease)
    lock = sessions.connect()
    try:
        lock.execute("SELECT pg_try_advisory_lock(1)")
        lock.execute("SELECT pg_advisory_unlock(1)")
    finally:
        lock.close()
    store.get_payload(lease.work_item_id, tenant="acme")
    store.commit(store.renew(lease), Outcome.SUCCEEDED)
    transport.ack(deliveries[0].receipt)
    store.now()


@pytest.mark.parametrize("immediate", [False, True], ids=["graceful", "crash"])
def test_no_operation_fails_after_a_restart(
    postgres_server: PostgresServer,
    parts: tuple[PostgresStore, PostgresTransport, SessionLockConnections],
    immediate: bool,
) -> None:
    store, transport, sessions = parts
    one_turn(store, transport, sessions, "before")
    fill(store._pool)
    assert transport._pool is not None
    fill(transport._pool)
    # Idle session-lock connections too (each one lent and given back healthy).
    lent = [sessions.connect() for _ in range(POOL)]
    for conn in lent:
        conn.execute("SELECT 1")
        conn.close()

    postgres_server.restart(immediate=immediate)  # returns once the server accepts connections

    one_turn(store, transport, sessions, "after")  # sequentially: each call on the next pooled connection
    failures: list[BaseException] = []

    def worker(index: int) -> Callable[[], None]:
        def run() -> None:
            try:
                one_turn(store, transport, sessions, f"thread-{index}")
            except BaseException as exc:
                failures.append(exc)

        return run

    threads = [threading.Thread(target=worker(i)) for i in range(POOL * 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures, failures
    assert transport.depth() == 0
