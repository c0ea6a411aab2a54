"""``agent-dispatch-worker``: claims deliveries, runs turns under fenced leases, commits, acknowledges."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from agent_dispatch.db.postgres import hung_up
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
    # Written by hand, not psycopg_pool: under the chaos suite a pooled version stalled claim loops
    # (a worker paused past its TTL, or the database restarted, and getconn() waited out the pool's
    # reconnect backoff with turns in flight); here a broken connection fails at once and is
    # replaced by the next connect(), which the session guard's retry already expects.
    """Dedicated autocommit connections for session advisory locks, reused across turns.

    Opening a connection per turn (a server process, authentication) cost more than all the
    other round trips of a no-op turn together. ``connect()`` lends an idle connection (or opens
    one); the lent connection's ``close()`` gives it back. A connection goes back only if every
    statement on it succeeded (so the session's explicit unlock ran: it holds no advisory lock),
    and one idle for half the lock's ``idle_session_timeout`` is discarded rather than reused
    (the server may end it at the full timeout). At most ``keep`` idle connections are kept.
    """

    def __init__(self, uri: str, *, idle_timeout_s: float, keep: int = 16) -> None:
        self._uri = uri
        self._max_idle_s = idle_timeout_s / 2
        self._keep = keep
        self._idle: list[tuple[float, Any]] = []
        self._lock = threading.Lock()

    def connect(self) -> _LentConnection:
        now = time.monotonic()
        with self._lock:
            while self._idle:
                returned_at, conn = self._idle.pop()
                # Never lend one the server has ended (a restart): its turn would fail for nothing.
                if now - returned_at < self._max_idle_s and not hung_up(conn):
                    return _LentConnection(self, conn)
                conn.close()
        import psycopg

        return _LentConnection(self, psycopg.connect(self._uri, autocommit=True))

    def _give_back(self, conn: Any, healthy: bool) -> None:
        if healthy and not conn.closed:
            with self._lock:
                if len(self._idle) < self._keep:
                    self._idle.append((time.monotonic(), conn))
                    return
        conn.close()


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

    session_connect: Callable[[], Any] | None = None
    if settings.state_db_uri is not None:
        session_connect = SessionLockConnections(
            settings.state_db_uri.get_secret_value(), idle_timeout_s=settings.claim_ttl_s
        ).connect

    def redrive() -> int:
        return dispatch.redrive(store, transport, settings=settings, signing_key=key)

    return Worker(
        settings,
        store,
        transport,
        executor,
        signing_key=key,
        concurrency=concurrency,
        session_connect=session_connect,
        redrive=redrive,
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
