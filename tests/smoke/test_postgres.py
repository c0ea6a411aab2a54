"""The loopback PostgreSQL is a real server: row locks, SKIP LOCKED claims, restarts that keep data."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import errors

from testenv.postgres import PostgresServer

pytestmark = pytest.mark.postgres

CLAIM = "SELECT id FROM jobs WHERE state = 'ready' ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"


def _make_jobs(dsn: str, count: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE jobs (id int PRIMARY KEY, state text NOT NULL DEFAULT 'ready')")
        conn.execute("INSERT INTO jobs (id) SELECT generate_series(1, %s)", (count,))


def test_skip_locked_claims_give_two_workers_different_rows(postgres_dsn: str) -> None:
    _make_jobs(postgres_dsn, 3)
    # Two connections stand for two workers; each holds its row lock in an open transaction.
    with psycopg.connect(postgres_dsn) as first, psycopg.connect(postgres_dsn) as second:
        first_row = first.execute(CLAIM).fetchone()
        second_row = second.execute(CLAIM).fetchone()
        assert first_row == (1,)
        assert second_row == (2,)

        # Without SKIP LOCKED the second worker would wait on the first one's row: proof the lock is real.
        second.execute("SET LOCAL lock_timeout = '200ms'")
        with pytest.raises(errors.LockNotAvailable):
            second.execute("SELECT id FROM jobs WHERE id = 1 FOR UPDATE")


def test_claimed_row_is_free_again_after_rollback(postgres_dsn: str) -> None:
    _make_jobs(postgres_dsn, 1)
    with psycopg.connect(postgres_dsn) as first, psycopg.connect(postgres_dsn) as second:
        assert first.execute(CLAIM).fetchone() == (1,)
        assert second.execute(CLAIM).fetchone() is None
        first.rollback()
        second.rollback()
        assert second.execute(CLAIM).fetchone() == (1,)


def test_server_reports_the_version_the_harness_names(
    postgres_server: PostgresServer, postgres_dsn: str
) -> None:
    with psycopg.connect(postgres_dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        version_num = conn.info.server_version
    assert row is not None
    assert postgres_server.version == f"PostgreSQL {row[0].split()[0]}"
    assert version_num >= 150000


def test_restart_keeps_port_and_data(postgres_server: PostgresServer, postgres_dsn: str) -> None:
    _make_jobs(postgres_dsn, 2)
    port = postgres_server.port
    postgres_server.restart()
    assert postgres_server.port == port
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (2,)
