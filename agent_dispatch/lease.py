"""Keeping a WorkItem lease alive while a turn runs, and serialising turns of one session.

:class:`WorkItemLeaseGuard` renews in the background and, synchronously, right before every
side effect an executor routes through :meth:`WorkItemLeaseGuard.side_effect`; a lost, fenced
or cancelled lease raises there, so a stale worker cannot act. :func:`session_execution_guard`
keeps one session's turns from overlapping, fleet-wide when PostgreSQL is configured.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, ParamSpec, Self, TypeVar

from agent_dispatch.errors import Cancelled, Fenced, LeaseHeld, LeaseLost
from agent_dispatch.models import Lease
from agent_dispatch.store import WorkItemStore

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class WorkItemLeaseGuard:
    """Holds a lease for the duration of one turn.

    The renewal thread runs in a copy of the caller's :mod:`contextvars` context, so request ids
    and logging context follow it (the reference implementation lost its context and fenced long
    turns). Executors read :attr:`fencing_token` and :attr:`lease_epoch` to pass downstream, and
    poll :attr:`cancelled` (or call :meth:`check`) to learn of cancellation promptly.
    """

    def __init__(
        self,
        store: WorkItemStore,
        lease: Lease,
        *,
        ttl_s: float,
        interval_s: float,
        on_renew: Callable[[], None] | None = None,
        on_lost: Callable[[LeaseLost], None] | None = None,
    ) -> None:
        self._store = store
        self._lease = lease
        self._ttl_s = ttl_s
        self._interval_s = interval_s
        self._on_renew = on_renew
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._lost: LeaseLost | None = None
        self.cancelled = threading.Event()
        self.lost = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def lease(self) -> Lease:
        return self._lease

    @property
    def fencing_token(self) -> int:
        return self._lease.fencing_token

    @property
    def lease_epoch(self) -> int:
        return self._lease.lease_epoch

    def __enter__(self) -> Self:
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run,
            args=(self._renew_loop,),
            name=f"lease-{self._lease.work_item_id[:8]}",
            daemon=True,
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._ttl_s)

    def revoke(self, reason: str) -> None:
        """Give the lease up (shutdown past its grace): the executor's next check or side effect raises."""
        self._stop.set()
        self._mark_lost(Fenced(reason))

    def check(self) -> None:
        """Raise the loss if the lease is already known lost (cheap; no round trip)."""
        if self._lost is not None:
            raise self._lost

    def renew(self) -> Lease:
        """Renew now; raises (and remembers) :class:`LeaseLost` when the lease is no longer ours."""
        with self._lock:
            self.check()
            try:
                self._lease = self._store.renew(self._lease, ttl_s=self._ttl_s)
                if self._on_renew is not None:
                    self._on_renew()  # may raise LeaseLost too (e.g. the session lock is gone)
            except LeaseLost as exc:
                self._mark_lost(exc)
                raise
            return self._lease

    def side_effect(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Renew synchronously, then run ``fn``: a stale worker never reaches ``fn``."""
        self.renew()
        return fn(*args, **kwargs)

    def _mark_lost(self, exc: LeaseLost) -> None:
        if self._lost is None:
            self._lost = exc
            self.lost.set()
            if isinstance(exc, Cancelled):
                self.cancelled.set()
            if self._on_lost is not None:
                self._on_lost(exc)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.renew()
            except LeaseLost:
                return
            except Exception:
                # A transient store error is not a lost lease: retry sooner, the expiry still protects.
                log.warning("lease renewal failed; retrying", exc_info=True)
                if self._stop.wait(min(1.0, self._interval_s / 2)):
                    return


# --- session serialisation ----------------------------------------------------------------------

_local_locks: dict[str, tuple[threading.Lock, int]] = {}
_local_guard = threading.Lock()


@contextlib.contextmanager
def _local_session_lock(session_id: str, timeout_s: float) -> Iterator[None]:
    with _local_guard:
        lock, users = _local_locks.get(session_id, (threading.Lock(), 0))
        _local_locks[session_id] = (lock, users + 1)
    try:
        if not lock.acquire(timeout=timeout_s):
            raise LeaseHeld(f"session busy in this process for more than {timeout_s:g}s")
        try:
            yield
        finally:
            lock.release()
    finally:
        with _local_guard:
            lock, users = _local_locks[session_id]
            if users <= 1:
                del _local_locks[session_id]
            else:
                _local_locks[session_id] = (lock, users - 1)


def advisory_key(session_id: str) -> int:
    """A stable signed 64-bit key for pg advisory locks (hashtext is not guaranteed stable)."""
    return int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest(), "big", signed=True)


class SessionHold:
    """The session lock a turn holds; :meth:`keepalive` runs with every lease renewal."""

    def __init__(self, conn: Any | None = None) -> None:
        self._conn = conn

    def keepalive(self) -> None:
        if self._conn is None:
            return
        try:
            self._conn.execute("SELECT 1")
        except Exception:
            raise Fenced("session lock lost: its connection ended") from None


@contextlib.contextmanager
def _advisory_session_lock(
    connect: Callable[[], Any], session_id: str, timeout_s: float, idle_timeout_s: float | None
) -> Iterator[SessionHold]:
    # A dedicated autocommit connection: the session-level advisory lock is held without an open
    # transaction, so no pooled connection sits "idle in transaction" for the whole turn.
    conn = connect()
    try:
        key = advisory_key(session_id)
        if idle_timeout_s is not None:
            # A holder that stalls (SIGSTOP, partition) past its lease loses the lock with its
            # session; a live holder touches the connection at every renewal (SessionHold.keepalive).
            # One round trip: the timeout is set and the first lock attempt made in one statement.
            got = conn.execute(
                "SELECT set_config('idle_session_timeout', %s, false), pg_try_advisory_lock(%s)",
                (f"{int(idle_timeout_s * 1000)}ms", key),
            ).fetchone()[1]
        else:
            got = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while not got:
            if time.monotonic() >= deadline:
                raise LeaseHeld(f"session busy on another worker for more than {timeout_s:g}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
            got = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]
        try:
            yield SessionHold(conn)
        finally:
            with contextlib.suppress(Exception):
                conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
    finally:
        conn.close()


@contextlib.contextmanager
def session_execution_guard(
    session_id: str,
    *,
    timeout_s: float,
    connect: Callable[[], Any] | None = None,
    idle_timeout_s: float | None = None,
) -> Iterator[SessionHold]:
    """Run one session's turns one at a time: a local lock, plus a PostgreSQL advisory lock
    (``connect`` returns a new autocommit psycopg connection) when shared state is configured.
    Waits at most ``timeout_s`` and raises :class:`LeaseHeld`, so the caller can redeliver later.
    With ``idle_timeout_s`` (the claim TTL), a stalled holder's lock is released by the server.
    """
    with _local_session_lock(session_id, timeout_s):
        if connect is None:
            yield SessionHold()
            return
        with _advisory_session_lock(connect, session_id, timeout_s, idle_timeout_s) as hold:
            yield hold
