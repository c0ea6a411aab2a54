"""``agent-dispatch-worker``: claims deliveries, runs turns under fenced leases, commits, acknowledges."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from psycopg_pool import ConnectionPool

from agent_dispatch.db.postgres import make_pool
from agent_dispatch.k8s_client import new_api_client
from agent_dispatch.runtime import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, Runtime, StartupError, open_runtime
from agent_dispatch.settings import Settings
from agent_dispatch.worker._executors import Executor, TurnFailed, load_executor
from agent_dispatch.worker._heartbeat import LeaseHeartbeat, lease_name
from agent_dispatch.worker._loop import Worker, WorkerState

__all__ = [
    "Executor",
    "LeaseHeartbeat",
    "TurnFailed",
    "Worker",
    "WorkerStartupError",
    "WorkerState",
    "build_worker",
    "lease_name",
    "run_worker",
]

log = logging.getLogger("agent_dispatch.worker")


#: The one start-up error of every entry point (kept under the worker's old name too).
WorkerStartupError = StartupError


class SessionLockConnections:
    """Dedicated autocommit connections for session advisory locks, pooled (psycopg_pool) across turns.

    Opening a connection per turn (a server process, authentication) cost more than all the
    other round trips of a no-op turn together. ``connect()`` lends a pooled connection; the lent
    connection's ``close()`` gives it back. One whose statement failed is closed instead (its
    explicit unlock may not have run; ending the session releases its advisory locks).

    Fail-fast by configuration (issue 20: an earlier psycopg_pool version stalled claim loops in
    the chaos suite, with getconn() waiting out the pool's backoffs while turns were in flight):

    - the borrow check is :func:`agent_dispatch.db.postgres.make_pool`'s: a connection the server
      ended (a restart, or ``idle_session_timeout`` after this process was paused past the lease)
      is found by a poll of its socket and drains the pool, so no borrower sleeps the 1-2-4 s
      check backoff stepping over dead connections one by one;
    - ``max_idle`` closes a connection idle for half the lock's ``idle_session_timeout`` before the
      server ends it; ``min_size`` 0, so an idle worker holds none;
    - ``reconnect_timeout`` gives up a failed background connect after ``RECONNECT_S`` instead of
      retrying with growing delays for five minutes (during which no other connect starts), and a
      borrow waits at most ``BORROW_S``: while the database is down, a turn fails at once and is
      redelivered, as with a plain connect, and the first borrow after it returns connects anew.
    """

    #: Longest a borrow waits for a connection; and how long a failed background connect is retried.
    BORROW_S = 3.0
    RECONNECT_S = 2.0

    def __init__(self, uri: str, *, idle_timeout_s: float, max_size: int = 64) -> None:
        self._pool: ConnectionPool[Any] = make_pool(
            uri,
            name="agent-dispatch-session-locks",
            kwargs={"autocommit": True, "connect_timeout": int(self.BORROW_S)},
            min_size=0,
            max_size=max_size,
            timeout=self.BORROW_S,
            max_idle=idle_timeout_s / 2,
            reconnect_timeout=self.RECONNECT_S,
        )
        self._opened = False
        self._lock = threading.Lock()

    def connect(self) -> _LentConnection:
        if not self._opened:
            with self._lock:
                if not self._opened:
                    self._pool.open(wait=False)
                    self._opened = True
        return _LentConnection(self, self._pool.getconn())

    def _give_back(self, conn: Any, healthy: bool) -> None:
        if not healthy:
            conn.close()  # the pool discards a closed connection (and ending it drops its locks)
        self._pool.putconn(conn)

    def close(self) -> None:
        self._pool.close()


class _LentConnection:
    """What :func:`agent_dispatch.lease.session_execution_guard` uses: ``execute`` and ``close``."""

    def __init__(self, owner: SessionLockConnections, conn: Any) -> None:
        self._owner = owner
        self._conn: Any = conn
        self._healthy = True

    def execute(self, query: Any, params: Any = None) -> Any:
        if self._conn is None:
            raise RuntimeError("connection already given back")
        try:
            return self._conn.execute(query, params)
        except BaseException:
            self._healthy = False
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._owner._give_back(conn, self._healthy)


def build_worker(
    settings: Settings, *, concurrency: int | None = None, runtime: Runtime | None = None
) -> Worker:
    """Assemble a worker (not started) over ``runtime``'s store and transport, or over ones
    opened here from the settings. ``StartupError`` says why it cannot start, with the exit code."""
    from agent_dispatch import dispatch

    try:
        executor = load_executor(settings)
    except ValueError as exc:
        raise StartupError(f"invalid setting {exc}", EXIT_USAGE) from None
    parts = runtime if runtime is not None else open_runtime(settings)
    store, transport, key = parts.store, parts.transport, parts.signing_key

    session_locks: SessionLockConnections | None = None
    if settings.state_db_uri is not None:
        session_locks = SessionLockConnections(
            settings.state_db_uri.get_secret_value(),
            idle_timeout_s=settings.claim_ttl_s,
            max_size=2 * (concurrency or settings.concurrency),
        )

    def redrive() -> int:
        return dispatch.redrive(store, transport, settings=settings, signing_key=key)

    return Worker(
        settings,
        store,
        transport,
        executor,
        signing_key=key,
        concurrency=concurrency,
        session_connect=session_locks.connect if session_locks is not None else None,
        redrive=redrive,
        # Closed when the worker stops; nothing else holds it (left open, its threads and idle
        # connection lived on until some later garbage collection).
        on_stopped=session_locks.close if session_locks is not None else None,
    )


def run_worker(settings: Settings, *, concurrency: int | None = None) -> int:
    """Run until SIGTERM/SIGINT; then drain within the grace period. Returns the exit code."""
    from agent_dispatch.worker._http import serve

    try:
        worker = build_worker(settings, concurrency=concurrency)
    except StartupError as exc:
        print(f"agent-dispatch worker: {exc}", flush=True)
        return exc.exit_code

    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)

    server = None
    if settings.metrics_port:
        server = serve(worker.state, settings.metrics_port, stale_after_s=max(30.0, settings.claim_ttl_s))
    heartbeat = None
    if settings.instance and settings.namespace:
        api = new_api_client(settings.kubeconfig, default_kubeconfig=False)
        if api is not None:
            heartbeat = LeaseHeartbeat(
                api,
                settings.namespace,
                settings.instance,
                worker.worker_id,
                duration_s=int(settings.claim_ttl_s),
                interval_s=settings.effective_renew_interval_s,
                pod_uid=settings.pod_uid,
            )
            heartbeat.start()
    worker.start()
    stop.wait()
    log.info("stopping: no new claims; draining", extra={"grace_s": settings.shutdown_grace_s})
    worker.stop()
    if heartbeat is not None:
        heartbeat.stop()
    if server is not None:
        server.shutdown()
    worker.transport.close()
    worker.store.close()
    # SIGTERM is how a pod is told to stop (a clean stop); Ctrl-C is an interruption.
    return EXIT_INTERRUPTED if received and received[0] == signal.SIGINT else EXIT_OK
