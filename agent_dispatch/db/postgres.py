"""PostgreSQL plumbing shared by the WorkItem store and the queue: the retry rule, error text, and
pools whose connections survive a server restart."""

from __future__ import annotations

import random
import select
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

import psycopg
from psycopg import Connection, errors
from psycopg_pool import ConnectionPool

CT = TypeVar("CT", bound=Connection[Any])

R = TypeVar("R")

#: Transactions the server rolled back whole to break a deadlock or a serialization conflict:
#: running them again is safe, and the usual cure.
RETRYABLE: Final = (errors.DeadlockDetected, errors.SerializationFailure)
ATTEMPTS: Final = 5


def retrying(transaction: Callable[[], R]) -> R:
    """Run ``transaction``; run it again (up to :data:`ATTEMPTS` in all, with a short jittered
    pause that grows) while the server picks it as a deadlock or serialization victim."""
    for attempt in range(ATTEMPTS):
        try:
            return transaction()
        except RETRYABLE:
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(random.uniform(0.001, 0.02) * (attempt + 1))  # noqa: S311 (jitter)
    raise AssertionError("unreachable")


def first_line(exc: BaseException) -> str:
    """An error's first line (psycopg's messages continue with context), or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- pooled connections that survive a server restart ------------------------------------------


def hung_up(conn: Connection[Any]) -> bool:
    """Whether the server has ended this idle connection (cheap: one poll of its socket).

    An idle connection has nothing to read; when the server ends it (a restart, an
    administrator's terminate, ``idle_session_timeout``), the socket turns readable with the
    server's farewell and end-of-file. A readable socket is confirmed with an empty statement
    (a round trip), so a stray message on a live connection costs nothing but that round trip.
    """
    if conn.closed:
        return True
    try:
        poller = select.poll()
        poller.register(conn.pgconn.socket, select.POLLIN | select.POLLERR | select.POLLHUP)
        if not poller.poll(0):
            return False
    except (OSError, psycopg.OperationalError):
        return True
    try:
        conn.execute("")
    except psycopg.Error:
        return True
    return False


def make_pool(
    conninfo: str,
    *,
    name: str,
    kwargs: dict[str, Any],
    min_size: int = 1,
    max_size: int = 10,
    timeout: float = 30.0,
    connection_class: type[CT] = Connection,  # type: ignore[assignment]
    **options: Any,
) -> ConnectionPool[CT]:
    """A psycopg_pool that lends no connection the server has ended (not opened: ``open`` it).

    Without a check, a server restart left every idle pooled connection broken, and each failed
    the one operation that next borrowed it (docs/reliability.md, finding 8). psycopg_pool's own
    ``check_connection`` costs a round trip per borrow; :func:`hung_up` costs a poll. The first
    hung-up connection found also drains the pool: after a restart every idle connection is dead,
    and stepping over them one by one would sleep the pool's check backoff (1 s, 2 s, 4 s...)
    between them, so the borrower instead waits only for one fresh connection. ``options`` go to
    ``ConnectionPool`` as they are (``max_idle``, ``reconnect_timeout``...).
    """
    pool: ConnectionPool[CT]

    def check(conn: CT) -> None:
        if hung_up(conn):
            pool.drain()
            raise psycopg.OperationalError("the server ended this pooled connection")

    pool = ConnectionPool(
        conninfo,
        min_size=min_size,
        max_size=max_size,
        open=False,
        connection_class=connection_class,
        kwargs=kwargs,
        timeout=timeout,
        check=check,
        name=name,
        **options,
    )
    return pool
