"""What ``build_worker`` opens for a worker alone is closed when the worker stops (real PostgreSQL)."""

from __future__ import annotations

import psycopg
import pytest

from agent_dispatch.models import WorkState
from agent_dispatch.settings import load
from agent_dispatch.worker import build_worker
from tests.worker._support import KEY, enqueue, wait_for

pytestmark = pytest.mark.postgres

#: The session-lock connection's last statement once a batch gave its locks back.
UNLOCK = "SELECT pg_advisory_unlock_all()"


def _lock_sessions(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = %s",
            (UNLOCK,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_stopped_worker_closes_its_session_lock_connections(postgres_dsn: str) -> None:
    """Nothing else closed them: each stopped worker left an open pool (its threads, and a
    connection held until the server's idle timeout) to a finalizer at some later collection."""
    settings = load(
        STATE_DB_URI=postgres_dsn,
        TASK_QUEUE_BACKEND="postgres",
        AGENT_DISPATCH_SIGNING_KEY=KEY.decode(),
        AGENT_DISPATCH_EXECUTOR="noop",
        AGENT_DISPATCH_CONCURRENCY=1,
    )
    worker = build_worker(settings)
    store, transport = worker.store, worker.transport
    try:
        store.migrate()
        worker.start()
        item = enqueue(store, transport)
        wait_for(lambda: store.get(item.id).state is WorkState.SUCCEEDED, what="the turn to succeed")
        wait_for(lambda: _lock_sessions(postgres_dsn) == 1, what="the idle session-lock connection")
        worker.stop(grace_s=1)
        wait_for(lambda: _lock_sessions(postgres_dsn) == 0, timeout=10, what="the session locks' pool closed")
    finally:
        worker.stop(grace_s=0)
        transport.close()
        store.close()
