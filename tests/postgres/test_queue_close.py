"""Closing the PostgreSQL queue does not wait on its maintenance thread's borrow from the pool."""

from __future__ import annotations

import threading
import time

import pytest

from agent_dispatch.transports.postgres import PostgresTransport
from tests.worker._support import wait_for

pytestmark = pytest.mark.postgres


def test_close_ends_a_maintenance_pass_that_waits_for_a_pooled_connection(postgres_dsn: str) -> None:
    """The maintenance thread's pass waited for a pooled connection (all in use) while close()
    joined it for up to 5 s before closing the pool; seen as 11 s teardowns in the tests. The pool
    now closes first, which fails the waiting borrow at once."""
    transport = PostgresTransport(
        postgres_dsn,
        max_depth=10,
        visibility_timeout_s=30,
        pool_max_size=1,
        connect_timeout_s=30,
        history_prune_interval_s=0.1,
        vacuum_interval_s=0,
    )
    transport.ensure_ready()
    transport.claim("w1", wait_s=0)  # a claiming transport runs the maintenance thread
    pool = transport._pool
    assert pool is not None
    held = pool.getconn()  # the pool's one connection: the next pass waits for it
    try:
        wait_for(
            lambda: pool.get_stats().get("requests_waiting", 0) >= 1, what="the pass to wait on the pool"
        )
        closer = threading.Thread(target=transport.close)
        started = time.monotonic()
        closer.start()
        closer.join(timeout=20)
        assert not closer.is_alive(), "close() hung"
        # (Waiting out the join took 5 s, the join's own bound; the borrow's timeout here is 30 s.)
        assert time.monotonic() - started < 3.0, "close() waited for the maintenance pass's borrow"
    finally:
        pool.putconn(held)
