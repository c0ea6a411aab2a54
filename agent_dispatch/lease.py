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
import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
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
        renewer: LeaseRenewer | None = None,
    ) -> None:
        self._store = store
        self._renewer = renewer
        self._context: contextvars.Context | None = None
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
        if self._renewer is not None:
            self._context = context
            self._renewer.add(self)
            return self
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
        if self._renewer is not None:
            self._renewer.discard(self)
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

    def verify(self) -> None:
        """Ask the store whether the lease is still current (one read, no renewal); raise and
        remember the loss. For executors that wait long between side effects: a cancellation
        reaches them at their next call, not at the next renewal (up to the renew interval)."""
        self.check()
        try:
            self._store.require_current(self._lease)
        except LeaseLost as exc:
            self._mark_lost(exc)
            raise

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

    def _tick(self) -> float | None:
        """One scheduled renewal (by a :class:`LeaseRenewer`): seconds until the next, or None."""
        if self._stop.is_set():
            return None
        try:
            assert self._context is not None
            self._context.run(self.renew)
        except LeaseLost:
            return None
        except Exception:
            log.warning("lease renewal failed; retrying", exc_info=True)
            return min(1.0, self._interval_s / 2)
        return self._interval_s

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


class LeaseRenewer:
    """One thread that renews every registered guard on its schedule.

    A thread per turn costs a start and a join on every turn, which short turns feel; a worker
    shares one renewer between its claim loops instead. Renewals run one after another, so a
    store that stalls delays them all alike (the lease expiry still protects).
    """

    def __init__(self, name: str = "lease-renewer") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, WorkItemLeaseGuard]] = []
        self._active: set[int] = set()
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, guard: WorkItemLeaseGuard) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._active.add(id(guard))
            self._push(guard, guard._interval_s)

    def discard(self, guard: WorkItemLeaseGuard) -> None:
        with self._cond:
            self._active.discard(id(guard))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _push(self, guard: WorkItemLeaseGuard, delay_s: float) -> None:
        self._seq += 1
        heapq.heappush(self._due, (time.monotonic() + delay_s, self._seq, guard))
        self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    # Discarded guards are dropped lazily, as they reach the front.
                    while self._due and id(self._due[0][2]) not in self._active:
                        heapq.heappop(self._due)
                    wait = self._due[0][0] - time.monotonic() if self._due else None
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._closed:
                    return
                _, _, guard = heapq.heappop(self._due)
            next_s = guard._tick()
            with self._cond:
                if next_s is not None and id(guard) in self._active:
                    self._push(guard, next_s)


# --- session serialisation ----------------------------------------------------------------------

_local_locks: dict[str, tuple[threading.Lock, int]] = {}
_local_guard = threading.Lock()


def _enter_local(session_id: str) -> threading.Lock:
    with _local_guard:
        lock, users = _local_locks.get(session_id, (threading.Lock(), 0))
        _local_locks[session_id] = (lock, users + 1)
    return lock


def _leave_local(session_id: str) -> None:
    with _local_guard:
        lock, users = _local_locks[session_id]
        if users <= 1:
            del _local_locks[session_id]
        else:
            _local_locks[session_id] = (lock, users - 1)


@contextlib.contextmanager
def _local_session_lock(session_id: str, timeout_s: float) -> Iterator[None]:
    lock = _enter_local(session_id)
    try:
        if not lock.acquire(timeout=timeout_s):
            raise LeaseHeld(f"session busy in this process for more than {timeout_s:g}s")
        try:
            yield
        finally:
            lock.release()
    finally:
        _leave_local(session_id)


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
def session_batch_guard(
    session_ids: Iterable[str],
    *,
    connect: Callable[[], Any] | None = None,
    idle_timeout_s: float | None = None,
) -> Iterator[tuple[SessionHold, set[str]]]:
    """Take the session locks of a batch of turns without waiting; yields the sessions held.

    The batch counterpart of :func:`session_execution_guard`: every session lock of the batch is
    tried in one statement on one lent connection and released in one, so a batch of short turns
    costs two round trips instead of two per turn. A session that is busy elsewhere (another
    thread or worker) is left out; the caller hands those turns back rather than waiting while it
    holds other leases.
    """
    local: list[tuple[str, threading.Lock, bool]] = []
    held: set[str] = set()
    try:
        for session_id in dict.fromkeys(session_ids):
            lock = _enter_local(session_id)
            got = lock.acquire(blocking=False)
            local.append((session_id, lock, got))
            if got:
                held.add(session_id)
        if connect is None or not held:
            yield SessionHold(), held
            return
        conn = connect()
        try:
            keys = {advisory_key(s): s for s in held}
            timeout = f"{int(idle_timeout_s * 1000)}ms" if idle_timeout_s is not None else None
            # One round trip: the stall timeout (see _advisory_session_lock) and every lock.
            rows = conn.execute(
                "SELECT k, pg_try_advisory_lock(k) FROM (SELECT set_config('idle_session_timeout',"
                " coalesce(%s, current_setting('idle_session_timeout')), false)) AS c,"
                " unnest(%s::bigint[]) AS k",
                (timeout, list(keys)),
            ).fetchall()
            held.difference_update(keys[key] for key, got in rows if not got)
            try:
                yield SessionHold(conn), held
            finally:
                with contextlib.suppress(Exception):
                    # The connection is dedicated to these locks, so releasing all of them is exact.
                    conn.execute("SELECT pg_advisory_unlock_all()")
        finally:
            conn.close()
    finally:
        for session_id, lock, got in local:
            if got:
                lock.release()
            _leave_local(session_id)


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
