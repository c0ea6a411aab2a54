"""PostgreSQL transport: ``agent_dispatch_queue`` with fair ``FOR UPDATE SKIP LOCKED`` claims.

Claim order: expired deadlines first, then priority (higher first), least recently served
tenant, least recently served fairness group, deadline, enqueue time, id. The bookkeeping that
keeps that order at a flat cost as the backlog and the tenant count grow lives in
``sql/queue.sql`` (see :mod:`agent_dispatch.transports.postgres.schema`); this module is the Python side: connection pool,
opaque scheduling references, receipts, LISTEN/NOTIFY wake-ups and error mapping.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, TypeVar

import psycopg
from psycopg import sql
from psycopg.rows import TupleRow, tuple_row
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from agent_dispatch.db.migrate import apply
from agent_dispatch.db.postgres import make_pool, retrying
from agent_dispatch.errors import BackendUnavailable, DepthUnavailable, Fenced, QueueFull
from agent_dispatch.settings import IO_THREADS, Backend, Settings
from agent_dispatch.transport import Delivery, OutboundTurn, Receipt
from agent_dispatch.transports.postgres import schema
from agent_dispatch.transports.postgres._parts import _Claim, _Maintenance, _ts, _Waker
from agent_dispatch.transports.postgres.schema import QUERIES

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Group of a turn that names none: one lane per tenant.
DEFAULT_GROUP: Final = ""
_REF_BYTES: Final = 16
#: Zero counters one prune call examines, and calls per prune.
_PRUNE_LIMIT: Final = 1000
_PRUNE_ROUNDS: Final = 10
#: Dead rows that make the maintenance vacuum a small fairness table / the queue itself (at least
#: this many, and at least this share of its live rows).
_VACUUM_SMALL_DEAD: Final = 1000
_VACUUM_QUEUE_DEAD: Final = 10_000
_VACUUM_QUEUE_SHARE: Final = 0.05
#: What a depth read or an admission says when the admission counter row is gone.
_COUNTER_MISSING: Final = "postgres queue: the depth counter row is missing"


class PostgresTransport:
    """The PostgreSQL queue. Thread-safe: worker threads share one instance and its pool."""

    backend = Backend.POSTGRES

    def __init__(
        self,
        dsn: str,
        *,
        max_depth: int,
        visibility_timeout_s: float,
        signing_key: bytes | None = None,
        pool_max_size: int = IO_THREADS,
        connect_timeout_s: float = 10.0,
        statement_timeout_s: float = 30.0,
        poll_interval_s: float = 1.0,
        history_prune_interval_s: float = 10.0,
        vacuum_interval_s: float = 5.0,
    ) -> None:
        self.dsn = dsn
        self.max_depth = max_depth
        self.visibility_timeout_s = visibility_timeout_s
        self.poll_interval_s = poll_interval_s
        #: Once a transport has claimed, a maintenance thread removes the fairness history of
        #: tenants and groups left without queued work every ``history_prune_interval_s``
        #: (:meth:`prune_history`) and vacuums the queue's tables that hold many dead rows every
        #: ``vacuum_interval_s`` (:meth:`vacuum`); 0 disables either.
        self.history_prune_interval_s = history_prune_interval_s
        self.vacuum_interval_s = vacuum_interval_s
        self._next_prune = 0.0
        self._next_vacuum = 0.0
        self._may_vacuum: bool | None = None
        self._maintenance: _Maintenance | None = None
        self._signing_key = signing_key
        self._connect_timeout_s = connect_timeout_s
        # Timeouts on every statement and lock wait: a wedged server fails calls, never hangs them.
        self._conn_kwargs: dict[str, object] = {
            "autocommit": True,
            "connect_timeout": max(1, int(connect_timeout_s)),
            "options": f"-c statement_timeout={int(statement_timeout_s * 1000)} "
            f"-c lock_timeout={int(statement_timeout_s * 1000)}",
        }
        self._pool_max_size = pool_max_size
        self._pool: ConnectionPool[psycopg.Connection[TupleRow]] | None = None
        self._ref_key: bytes | None = None
        self._lock = threading.Lock()
        self._waker: _Waker | None = None
        self._wakeups = 0  # wake_claims() calls: a claim that sees it change returns
        self._closed = False

    @classmethod
    def from_settings(cls, settings: Settings) -> PostgresTransport:
        if settings.state_db_uri is None:
            raise BackendUnavailable("postgres transport: STATE_DB_URI is not set")
        key = settings.signing_key.get_secret_value().encode() if settings.signing_key else None
        return cls(
            settings.state_db_uri.get_secret_value(),
            max_depth=settings.max_depth,
            visibility_timeout_s=settings.effective_visibility_timeout_s,
            signing_key=key,
        )

    @property
    def database_identity(self) -> str:
        """The database, as the PostgreSQL WorkItem store names it: equal means one transaction can span both."""
        return self.dsn

    # -- lifecycle -------------------------------------------------------------------------

    def ensure_ready(self) -> None:
        """Open the pool, create or check the schema; ``BackendUnavailable`` if unreachable."""
        with self._lock:
            if self._ref_key is not None:
                return
            # Checked on every borrow (a poll, no round trip), so a server restart fails no call.
            pool: ConnectionPool[psycopg.Connection[TupleRow]] = make_pool(
                self.dsn,
                max_size=self._pool_max_size,
                kwargs=self._conn_kwargs,
                timeout=self._connect_timeout_s,
                name="agent-dispatch-queue",
            )
            try:
                pool.open(wait=True, timeout=self._connect_timeout_s)
                with pool.connection() as conn, conn.transaction():
                    salt = self._create_schema(conn)
            except (psycopg.OperationalError, PoolTimeout) as exc:
                # A pool left open would keep reconnecting in the background; start clean next time.
                pool.close()
                raise BackendUnavailable(f"postgres transport unavailable ({type(exc).__name__})") from None
            except BaseException:
                pool.close()
                raise
            self._pool = pool
            # Scheduling columns hold a keyed hash of the tenant/group: opaque to anyone reading the
            # table. The salt is per database; with a signing key configured, the key is also secret
            # from a reader of the database.
            self._ref_key = (
                hmac.new(self._signing_key, salt, hashlib.sha256).digest() if self._signing_key else salt
            )

    @staticmethod
    def _create_schema(conn: psycopg.Connection[TupleRow]) -> bytes:
        """Create or upgrade the schema (:func:`agent_dispatch.db.migrate.apply`); return the ref salt."""
        apply(conn, schema.SCHEMA)
        conn.execute(QUERIES["meta_salt"], (secrets.token_bytes(32),))
        salt = conn.execute(QUERIES["meta_read_salt"]).fetchone()
        assert salt is not None
        return bytes(salt[0])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            waker, self._waker = self._waker, None
            maintenance, self._maintenance = self._maintenance, None
            pool, self._pool = self._pool, None
        # The pool closes before the maintenance thread is joined: a pass waiting for a pooled
        # connection then fails at once, where it kept close() waiting for the pool's timeout
        # (seen as 11 s teardowns in the tests).
        if maintenance is not None:
            maintenance.stop()
        if waker is not None:
            waker.close()
        if pool is not None:
            pool.close()
        if maintenance is not None:
            maintenance.join()

    # -- opaque scheduling references --------------------------------------------------------

    def tenant_ref(self, tenant: str) -> bytes:
        return self._ref(b"tenant", tenant.encode())

    def group_ref(self, tenant: str, group: str | None) -> bytes:
        return self._ref(b"group", tenant.encode(), (group or DEFAULT_GROUP).encode())

    def _ref(self, *parts: bytes) -> bytes:
        if self._ref_key is None:
            self.ensure_ready()
        assert self._ref_key is not None
        return hmac.new(self._ref_key, b"\x00".join(parts), hashlib.sha256).digest()[:_REF_BYTES]

    # -- admission -----------------------------------------------------------------------------

    def admit(self, turns: Sequence[OutboundTurn], *, bounded: bool = True) -> None:
        if not turns:
            return

        def run() -> None:
            self._ready()  # inside _call: an unreachable database is an unknown depth (fail closed)
            with self._conn() as conn:
                self.admit_on(conn, turns, bounded=bounded)

        self._call(run, unavailable=DepthUnavailable)

    def admit_on(
        self, conn: psycopg.Connection[Any], turns: Sequence[OutboundTurn], *, bounded: bool = True
    ) -> int:
        """Admit on the caller's connection, inside the caller's transaction (if any).

        The enqueue path uses this to submit a WorkItem and admit its envelope in ONE
        transaction when the WorkItem store lives in the same database. Returns the number of
        rows inserted (a WorkItem that already has a queued delivery is skipped). Raises
        ``QueueFull``, or ``DepthUnavailable`` when the depth counter is gone.
        """
        if not turns:
            return 0
        self._ready()
        columns = [
            (
                t.work_item_id,
                t.session_id,
                self.tenant_ref(t.tenant),
                self.group_ref(t.tenant, t.fairness_group),
                t.priority,
                _ts(t.deadline),
                _ts(t.not_before),
                t.wire,
            )
            for t in turns
        ]
        bound = self.max_depth if bounded else None
        # A lone turn (most submits) has a function of its own: the same effects, a third of the
        # batch function's server time (queue.sql).
        query, params = (
            (QUERIES["admit_one"], (*columns[0], bound))
            if len(columns) == 1
            else (QUERIES["admit"], (*(list(column) for column in zip(*columns, strict=True)), bound))
        )
        try:
            with conn.cursor(row_factory=tuple_row) as cur:
                cur.execute(query, params)
                row = cur.fetchone()
        except psycopg.Error as exc:
            if exc.sqlstate == schema.QUEUE_FULL_SQLSTATE:
                raise QueueFull(
                    f"postgres queue: {len(turns)} more would exceed the bound {self.max_depth}"
                ) from None
            if exc.sqlstate == schema.DEPTH_MISSING_SQLSTATE:
                raise DepthUnavailable(_COUNTER_MISSING) from None
            raise
        return int(row[0]) if row else 0

    def depth(self) -> int:
        def run() -> int:
            self._ready()
            with self._conn() as conn:
                row = conn.execute(QUERIES["depth"]).fetchone()
            if row is None:
                raise DepthUnavailable(_COUNTER_MISSING)
            return int(row[0])

        return self._call(run, unavailable=DepthUnavailable)

    # -- delivery ---------------------------------------------------------------------------

    def claim(self, owner: str, *, max_items: int = 1, wait_s: float = 0.0) -> list[Delivery]:
        if max_items < 1:
            return []
        self._ready()
        if self._maintenance is None:
            self._start_maintenance()
        deadline = time.monotonic() + max(wait_s, 0.0)
        waker = self._get_waker() if wait_s > 0 else None
        woken = self._wakeups
        while True:
            # Read the wake-up generation before trying, so a notify in between is not lost.
            seen = waker.generation if waker else 0
            got = self._call(lambda: self._claim_once(owner, max_items), unavailable=BackendUnavailable)
            if waker is not None and len(got) == max_items:
                waker.pass_on()
            remaining = deadline - time.monotonic()
            if got or remaining <= 0 or waker is None or self._wakeups != woken:
                return got
            waker.wait(seen, min(remaining, self.poll_interval_s))

    def wake_claims(self) -> None:
        with self._lock:
            self._wakeups += 1
            waker = self._waker
        if waker is not None:
            waker.wake_all()

    def _claim_once(self, owner: str, max_items: int) -> list[Delivery]:
        with self._conn() as conn:
            rows = conn.execute(
                QUERIES["claim"],
                (owner, max_items, self.visibility_timeout_s),
            ).fetchall()
        return [
            Delivery(
                wire=bytes(wire),
                receipt=Receipt(owner, _Claim(row_id, token, claimed_at).encode()),
                work_item_id=work_item_id,
                redelivered=deliveries - 1,
            )
            for row_id, work_item_id, wire, token, claimed_at, deliveries in rows
        ]

    def prune_history(self, *, limit: int = _PRUNE_LIMIT) -> int:
        """Remove the fairness history of groups and tenants with no queued row; returns the groups removed.

        Acknowledgements only count rows down (they never wait for the tenant locks that claims
        hold); this removes what they left at zero. A claiming transport calls it every
        ``history_prune_interval_s``; a tenant that gets work again before then keeps its history.
        """
        self._ready()

        def run() -> int:
            with self._conn() as conn:
                row = conn.execute(QUERIES["prune"], (limit,)).fetchone()
            return int(row[0]) if row else 0

        removed = total = self._call(run, unavailable=BackendUnavailable)
        for _ in range(_PRUNE_ROUNDS - 1):
            if removed < limit:
                break
            removed = self._call(run, unavailable=BackendUnavailable)
            total += removed
        return total

    def vacuum(
        self, *, min_dead_small: int = _VACUUM_SMALL_DEAD, min_dead_queue: int = _VACUUM_QUEUE_DEAD
    ) -> list[str]:
        """VACUUM the queue's tables that hold many dead rows; returns the tables vacuumed.

        Every claim rewrites a lane row of each of the small fairness tables (their indexed stamp
        moves), and every claim and ack leaves a dead queue row whose index entries later claims
        step over; autovacuum visits a database once a minute at most, which under load is tens of
        thousands of dead entries. The small tables cost milliseconds to vacuum; the queue only
        once its dead rows are both ``min_dead_queue`` and 5% of its live ones (its index
        cleanup reads whole indexes: 0.3 s at a million queued rows).
        """
        self._ready()

        def run() -> list[str]:
            with self._conn() as conn:
                stats = conn.execute(QUERIES["dead_rows"], (list(schema.TABLES),)).fetchall()
                due = [
                    name
                    for name, dead, live in stats
                    if (
                        dead >= max(min_dead_queue, _VACUUM_QUEUE_SHARE * live)
                        if name == schema.TABLES[0]
                        else dead >= min_dead_small
                    )
                ]
                if due:
                    conn.execute(
                        sql.SQL("VACUUM (SKIP_LOCKED) {}").format(
                            sql.SQL(", ").join(map(sql.Identifier, due))
                        )
                    )
            return due

        return self._call(run, unavailable=BackendUnavailable)

    def _start_maintenance(self) -> None:
        ticks = [t for t in (self.history_prune_interval_s, self.vacuum_interval_s) if t > 0]
        with self._lock:
            if self._maintenance is None and ticks and not self._closed:
                self._maintenance = _Maintenance(self._maintain, min(1.0, *ticks))

    def _maintain(self) -> None:
        now = time.monotonic()
        prune = self.history_prune_interval_s > 0 and self._next_prune <= now
        vacuum = self.vacuum_interval_s > 0 and self._next_vacuum <= now
        if prune:
            self._next_prune = now + self.history_prune_interval_s
            self.prune_history()
        if vacuum:
            self._next_vacuum = now + self.vacuum_interval_s
            if self._may_vacuum is None:
                self._may_vacuum = self._owns_tables()
                if not self._may_vacuum:
                    log.info(
                        "not vacuuming the queue's tables: this role does not own them (autovacuum does)"
                    )
            if self._may_vacuum:
                self.vacuum()

    def _owns_tables(self) -> bool:
        """Whether VACUUM would process the queue's tables rather than skip them with a warning."""
        with self._conn() as conn:
            row = conn.execute(QUERIES["owns_tables"], (list(schema.TABLES),)).fetchone()
        return bool(row and row[0])

    def ack(self, receipt: Receipt) -> None:
        if self.ack_many([receipt]):
            raise Fenced("postgres queue: the receipt is stale or foreign (the claim was reassigned)")

    def ack_many(self, receipts: Sequence[Receipt]) -> list[Receipt]:
        """Acknowledge a batch in one round trip; returns the receipts refused as stale or foreign."""
        self._ready()
        parsed = [(r, _Claim.decode(r.token)) for r in receipts]
        valid = [(r, c) for r, c in parsed if c is not None]
        refused = [r for r, c in parsed if c is None]
        if not valid:
            return refused

        def run() -> set[int]:
            with self._conn() as conn:
                rows = conn.execute(
                    QUERIES["ack"],
                    (
                        [c.row_id for _, c in valid],
                        [r.owner for r, _ in valid],
                        [c.token for _, c in valid],
                        [c.claimed_at for _, c in valid],
                    ),
                ).fetchall()
            return {int(row[0]) for row in rows}

        acked = self._call(run, unavailable=BackendUnavailable)
        return refused + [r for r, c in valid if c.row_id not in acked]

    def release(self, receipt: Receipt, *, delay_s: float = 0.0) -> None:
        self._ready()
        claim = _Claim.decode(receipt.token)
        if claim is None:
            raise Fenced("postgres queue: malformed receipt")

        def run() -> bool:
            with self._conn() as conn:
                row = conn.execute(
                    QUERIES["release"],
                    (claim.row_id, receipt.owner, claim.token, claim.claimed_at, max(delay_s, 0.0)),
                ).fetchone()
            return bool(row and row[0])

        if not self._call(run, unavailable=BackendUnavailable):
            raise Fenced("postgres queue: the receipt is stale or foreign (the claim was reassigned)")

    # -- internals --------------------------------------------------------------------------

    def _ready(self) -> None:
        if self._ref_key is None:
            self.ensure_ready()

    def _conn(self) -> AbstractContextManager[psycopg.Connection[TupleRow]]:
        if self._pool is None:
            raise BackendUnavailable("postgres transport is closed or not ready")
        return self._pool.connection()

    def _get_waker(self) -> _Waker:
        with self._lock:
            if self._waker is None and not self._closed:
                self._waker = _Waker(lambda: psycopg.connect(self.dsn, **self._conn_kwargs))  # type: ignore[arg-type]
            assert self._waker is not None
            return self._waker

    def _call(self, fn: Callable[[], T], *, unavailable: type[Exception]) -> T:
        """Run one transaction (retrying deadlock victims); map connection failures to ``unavailable``."""
        try:
            return retrying(fn)
        except (psycopg.OperationalError, PoolTimeout, PoolClosed, BackendUnavailable) as exc:
            raise unavailable(f"postgres transport unavailable ({type(exc).__name__})") from None
