"""A batch's session locks on a real PostgreSQL (the worker's batch path): one statement takes every
session not busy elsewhere, and they are released however the batch ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_dispatch.lease import advisory_key, session_batch_guard
from agent_dispatch.worker import SessionLockConnections

pytestmark = pytest.mark.postgres


@pytest.fixture
def sessions(postgres_dsn: str) -> Iterator[SessionLockConnections]:
    pool = SessionLockConnections(postgres_dsn, idle_timeout_s=30)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def other(postgres_dsn: str) -> Iterator[psycopg.Connection]:
    """Another worker's session-lock connection."""
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        yield conn


def _free(conn: psycopg.Connection, session_id: str) -> bool:
    """Whether another worker could take the session now (and lets it go again)."""
    key = advisory_key(session_id)
    got = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
    assert got is not None
    if got[0]:
        conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
    return bool(got[0])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    wanted=st.lists(st.sampled_from([f"s{i}" for i in range(8)]), min_size=1, max_size=12),
    busy=st.sets(st.sampled_from([f"s{i}" for i in range(8)]), max_size=4),
)
def test_the_batch_holds_every_session_not_busy_elsewhere(
    sessions: SessionLockConnections, other: psycopg.Connection, wanted: list[str], busy: set[str]
) -> None:
    for session_id in busy:
        other.execute("SELECT pg_advisory_lock(%s)", (advisory_key(session_id),))
    try:
        with session_batch_guard(wanted, connect=sessions.connect, idle_timeout_s=30) as (hold, held):
            assert held == set(wanted) - busy
            hold.keepalive()
            with psycopg.connect(other.info.dsn, autocommit=True) as third:
                assert not any(_free(third, s) for s in held)
        assert all(_free(other, s) for s in set(wanted) - busy)
    finally:
        other.execute("SELECT pg_advisory_unlock_all()")


def test_a_failed_batch_releases_the_sessions(
    sessions: SessionLockConnections, other: psycopg.Connection
) -> None:
    with contextlib.suppress(RuntimeError), session_batch_guard(["a", "b"], connect=sessions.connect):
        raise RuntimeError("the batch failed")
    assert _free(other, "a") and _free(other, "b")
    # Nothing was left held: the next batch takes the same sessions.
    with session_batch_guard(["a", "b"], connect=sessions.connect) as (_, held):
        assert held == {"a", "b"}
        assert not _free(other, "a")
