"""The PostgreSQL store's plumbing: the pool, transactions (with the one retry rule), the schema
check and migration, reads, the unfinished count's compare-and-admit (which a submit and the
dead-letter retry share), and leader election. Transitions live in ``_submit``, ``_inspect`` and
``store``."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Final, TypeVar

import psycopg
from psycopg import Connection
from psycopg.rows import DictRow, dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from agent_dispatch.db import sql
from agent_dispatch.db.migrate import ComponentVersions, Schema, apply, require
from agent_dispatch.db.postgres import first_line, make_pool, retrying
from agent_dispatch.errors import BackendUnavailable, DispatchError, Fenced, NotFound, QueueFull
from agent_dispatch.models import Lease, OutcomeRecord, WorkItem
from agent_dispatch.settings import IO_THREADS, Settings
from agent_dispatch.settings import load as load_settings
from agent_dispatch.store import SCHEMA_VERSION
from agent_dispatch.stores._calls import Listing, StoreCalls
from agent_dispatch.stores._common import (
    COMPONENT,
    MIGRATE_HINT,
    Limits,
    View,
    fence_violation,
    make_item,
    require_dt,
    view_of,
)
from agent_dispatch.stores.postgres.statements import (
    RECOVERABLE,
    SELECT_ITEM,
    SELECT_ITEMS,
    SELECT_NOW,
    SELECT_OUTCOMES,
    SELECT_PAYLOAD,
    SELECT_VIEW,
    list_items_sql,
)

R = TypeVar("R")
Conn = Connection[DictRow]

_UNFINISHED: Final = sql.load(__package__ or "agent_dispatch.stores.postgres", "sql/unfinished.sql")

#: The WorkItem schema on PostgreSQL: ``sql/v<N>.sql`` takes version N-1 to N.
SCHEMA: Final = Schema(
    title="the WorkItem schema in PostgreSQL",
    version=SCHEMA_VERSION,
    record=ComponentVersions("postgres", COMPONENT),
    steps={
        version: (sql.read(__package__ or "agent_dispatch.stores.postgres", f"sql/v{version}.sql"),)
        for version in range(1, SCHEMA_VERSION + 1)
    },
    # Serialises concurrent ``migrate`` runs.
    lock_key=0x6164_6D69_6772_0001,
    hint=MIGRATE_HINT,
)


def outcome_record(rec: DictRow) -> OutcomeRecord:
    """An outcome-log row (``OUTCOME_SELECT``'s columns) as the record every store returns."""
    return OutcomeRecord(
        work_item_id=rec["work_item_id"],
        tenant=rec["tenant"],
        event=rec["event"],
        owner=rec["owner"],
        lease_epoch=int(rec["lease_epoch"]),
        fencing_token=int(rec["fencing_token"]),
        at=require_dt(rec["at"]),
        outcome=rec["outcome"],
        detail=rec["detail"],
    )


def _leader_key(name: str) -> int:
    digest = hashlib.sha256(f"agent-dispatch:leader:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class PostgresBase(StoreCalls):
    """WorkItemStore on PostgreSQL through a psycopg connection pool: everything but transitions."""

    #: Class-level so a test can pose as newer code (see tests/contract).
    schema: Schema = SCHEMA

    def __init__(
        self,
        dsn: str,
        settings: Settings | None = None,
        *,
        min_size: int = 1,
        max_size: int = IO_THREADS,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.limits = Limits.of(settings or load_settings())
        self._dsn = dsn
        self._off = 0.0
        self._schema_ok = False
        self._lock = threading.Lock()
        self._leaders: dict[str, psycopg.Connection[Any]] = {}
        try:
            # One plain connection first: an unreachable server fails fast, once, with one message
            # (the pool would retry quietly until its timeout).
            psycopg.connect(dsn, connect_timeout=max(int(connect_timeout_s), 1)).close()
        except psycopg.Error as exc:
            raise BackendUnavailable(f"PostgreSQL (STATE_DB_URI) is unreachable: {first_line(exc)}") from exc
        # Checked on every borrow (a poll, no round trip), so a server restart fails no operation.
        self._pool: ConnectionPool[Conn] = make_pool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            connection_class=Connection[DictRow],
            kwargs={"autocommit": True, "row_factory": dict_row, "connect_timeout": int(connect_timeout_s)},
            name="agent-dispatch-store",
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
        except PoolTimeout as exc:
            self._pool.close()
            raise BackendUnavailable("PostgreSQL (STATE_DB_URI) is unreachable") from exc

    # --- plumbing -----------------------------------------------------------------------------------------

    def set_clock_offset_for_tests(self, seconds: float) -> None:
        """Test hook: every statement's ``now()`` is shifted by ``seconds`` (see the ``store`` module)."""
        self._off = float(seconds)

    def _p(self, **params: Any) -> dict[str, Any]:
        params["off"] = self._off
        return params

    def _run(self, fn: Callable[[Conn], R], *, transaction: bool = True, check_schema: bool = True) -> R:
        """Run ``fn`` on a pooled connection (in one transaction), retrying deadlock victims."""
        if check_schema and not self._schema_ok:
            self._run(lambda conn: require(conn, self.schema), transaction=False, check_schema=False)
            self._schema_ok = True

        def once() -> R:
            with self._pool.connection() as conn:
                if not transaction:
                    return fn(conn)
                with conn.transaction():
                    return fn(conn)

        try:
            return retrying(once)
        except (psycopg.OperationalError, PoolTimeout) as exc:
            raise BackendUnavailable(f"PostgreSQL is unavailable: {first_line(exc)}") from exc

    def _one(self, conn: Conn, sql: str, params: Mapping[str, Any]) -> DictRow | None:
        return conn.execute(sql, params).fetchone()

    def _view(self, conn: Conn, work_item_id: str) -> View | None:
        rec = self._one(conn, SELECT_VIEW, self._p(id=work_item_id))
        return None if rec is None else view_of(rec)

    def _fence_params(self, lease: Lease, **extra: Any) -> dict[str, Any]:
        return self._p(
            id=lease.work_item_id,
            tenant=lease.tenant,
            owner=lease.owner,
            epoch=lease.lease_epoch,
            token=lease.fencing_token,
            **extra,
        )

    def _refused(self, conn: Conn, lease: Lease) -> DispatchError:
        """The conditional UPDATE matched nothing: say exactly why."""
        violation = fence_violation(self._view(conn, lease.work_item_id), lease)
        # Everything matched on the re-read: the row changed between the two statements.
        return violation or Fenced(f"the lease on work item {lease.work_item_id} changed concurrently")

    # --- schema -------------------------------------------------------------------------------------------

    def migrate(self) -> int:
        version = self._run(lambda conn: apply(conn, self.schema), check_schema=False)
        self._schema_ok = True
        return version

    # --- clock and reads -------------------------------------------------------------------------------------

    def now(self) -> datetime:
        rec = self._run(lambda c: self._one(c, SELECT_NOW, self._p()), transaction=False, check_schema=False)
        assert rec is not None
        return require_dt(rec["now"])

    def get(self, work_item_id: str, *, tenant: str | None = None) -> WorkItem:
        rec = self._run(lambda c: self._one(c, SELECT_ITEM, {"id": work_item_id}), transaction=False)
        if rec is None or (tenant is not None and rec["tenant"] != tenant):
            raise NotFound(f"work item {work_item_id} not found")
        return make_item(rec)

    def get_many(self, work_item_ids: Sequence[str], *, tenant: str | None = None) -> dict[str, WorkItem]:
        if not work_item_ids:
            return {}
        rows = self._run(
            lambda c: c.execute(SELECT_ITEMS, {"ids": list(work_item_ids)}).fetchall(), transaction=False
        )
        return {rec["id"]: make_item(rec) for rec in rows if tenant is None or rec["tenant"] == tenant}

    def get_payload(self, work_item_id: str, *, tenant: str) -> bytes:
        rec = self._run(
            lambda c: self._one(c, SELECT_PAYLOAD, {"id": work_item_id, "tenant": tenant}), transaction=False
        )
        if rec is None:
            raise NotFound(f"work item {work_item_id} not found")
        return bytes(rec["payload"])

    def _list_items(self, page: Listing) -> list[WorkItem]:
        statement = list_items_sql(states=bool(page.states), after=page.after is not None)
        params = {
            "tenant": page.tenant,
            "states": [s.value for s in page.states],
            "after": page.after,
            "limit": page.limit,
        }
        rows = self._run(lambda c: c.execute(statement, params).fetchall(), transaction=False)
        return [make_item(rec) for rec in rows]

    def outcomes(self, work_item_id: str) -> list[OutcomeRecord]:
        rows = self._run(
            lambda c: c.execute(SELECT_OUTCOMES, {"id": work_item_id}).fetchall(), transaction=False
        )
        return [outcome_record(rec) for rec in rows]

    def recoverable(self, *, stale_after_s: float, limit: int = 1000) -> list[WorkItem]:
        params = self._p(stale=stale_after_s, limit=limit)
        rows = self._run(lambda c: c.execute(RECOVERABLE, params).fetchall(), transaction=False)
        return [make_item(rec) for rec in rows[:limit]]

    # --- the unfinished count (schema v2: kept by triggers; v3: one write per transaction) ---------------------

    def unfinished(self) -> int:
        rec = self._run(lambda c: self._one(c, _UNFINISHED["unfinished"], {}), transaction=False)
        assert rec is not None, "agent_dispatch_unfinished has its one row from the migration on"
        return int(rec["n"])

    def admit_unfinished(self, conn: Conn, created: Sequence[WorkItem], bound: int) -> None:
        """Compare-and-admit, as the last step of a transaction that makes items unfinished (a
        submit's ``then``, the dead-letter retry): the count plus the new unfinished items must
        stay within ``bound``, else ``QueueFull``.

        The row lock is taken last and held only until the commit, where the deferred trigger
        adds the transaction's new items under it (so no other submit or retry can take the same
        room).
        """
        new = sum(not item.state.terminal for item in created)
        if not new:
            return
        rec = self._one(conn, _UNFINISHED["lock_unfinished"], {})
        assert rec is not None, "agent_dispatch_unfinished has its one row from the migration on"
        if int(rec["n"]) + new > bound:
            raise QueueFull(f"{rec['n']} unfinished turns + {new} would exceed the bound {bound}")

    @property
    def database_identity(self) -> str:
        """Which database this store writes; the enqueue path compares it with the transport's."""
        return self._dsn

    # --- leader election and lifecycle -----------------------------------------------------------------------

    def try_lead(self, name: str) -> bool:
        """``pg_try_advisory_lock`` on a dedicated connection, kept open (and the lock held) while leading."""
        with self._lock:
            held = self._leaders.get(name)
            if held is not None:
                try:
                    held.execute("SELECT 1")
                    return True
                except psycopg.Error:
                    # The session (and with it the lock) is gone; compete again like anyone else.
                    self._leaders.pop(name, None)
                    held.close()
            try:
                conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=10)
            except psycopg.OperationalError as exc:
                raise BackendUnavailable("PostgreSQL is unavailable for leader election") from exc
            # If this leader stalls (paused, partitioned) past the timeout, the server ends its session
            # and so releases the lock; a live leader keeps it with the SELECT 1 above every sweep.
            idle_ms = int(self.limits.leader_idle_timeout_s * 1000)
            conn.execute("SELECT set_config('idle_session_timeout', %s, false)", (f"{idle_ms}ms",))
            rec = conn.execute("SELECT pg_try_advisory_lock(%s)", (_leader_key(name),)).fetchone()
            if rec is not None and rec[0]:
                self._leaders[name] = conn
                return True
            conn.close()
            return False

    def close(self) -> None:
        with self._lock:
            leaders, self._leaders = self._leaders, {}
        for conn in leaders.values():
            # Closing the session releases its locks too, but only once the server has read the
            # goodbye: unlocking first hands the lead over before close() returns.
            with contextlib.suppress(psycopg.Error):
                conn.execute("SELECT pg_advisory_unlock_all()")
            conn.close()
        self._pool.close()
