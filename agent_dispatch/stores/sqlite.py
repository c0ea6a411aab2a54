"""The SQLite WorkItem store: the local default, in the XDG data directory, no server needed.

Every write runs in ``BEGIN IMMEDIATE``, which takes SQLite's single writer lock up front, so
the read-check-write of the shared engine cannot race another thread or process. WAL mode lets
readers run beside that writer. Each thread gets its own connection (sqlite3 connections must
not be shared between threads mid-transaction).

Time comes from SQLite (``julianday('now')``) once per transaction, never from Python's clock.
``set_clock_offset_for_tests`` adds a fixed number of seconds to that reading; it exists only so
tests can age leases without sleeping, and production code never calls it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from agent_dispatch.errors import BackendUnavailable, DispatchError, SchemaOutdated
from agent_dispatch.models import Outcome, OutcomeRecord, SubmitRequest, SubmitResult, WorkItem, WorkState
from agent_dispatch.settings import Settings
from agent_dispatch.settings import load as load_settings
from agent_dispatch.store import SCHEMA_VERSION
from agent_dispatch.stores._common import (
    COMPONENT,
    MIGRATE_HINT,
    OUTCOME_SELECT,
    Limits,
    prepare_batch,
    prepare_submit,
    to_dt,
)
from agent_dispatch.stores._engine import ROW_FIELDS, EngineStore, Row

T: Final = "agent_dispatch_work_items"
DEPS: Final = "agent_dispatch_dependencies"
OUTCOMES: Final = "agent_dispatch_outcomes"
COUNTERS: Final = "agent_dispatch_counters"
VERSIONS: Final = "agent_dispatch_schema_version"

_ACTIVE: Final = "state IN ('ready', 'leased', 'running')"
_NON_TERMINAL: Final = "state IN ('submitted', 'ready', 'leased', 'running')"

#: version -> statements. Append new versions; never edit one that has shipped.
MIGRATIONS: Final[Mapping[int, Sequence[str]]] = {
    1: (
        f"""CREATE TABLE {COUNTERS} (name TEXT PRIMARY KEY, value INTEGER NOT NULL)""",
        f"""INSERT INTO {COUNTERS} (name, value) VALUES ('fencing_token', 0)""",
        f"""CREATE TABLE {T} (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            id TEXT NOT NULL UNIQUE,
            tenant TEXT NOT NULL CHECK (tenant <> ''),
            kind TEXT NOT NULL,
            queue TEXT NOT NULL,
            session_id TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('submitted', 'ready', 'leased', 'running',
                                                 'succeeded', 'failed', 'cancelled', 'dead_letter')),
            priority INTEGER NOT NULL,
            deadline REAL,
            attempt INTEGER NOT NULL CHECK (attempt >= 0 AND attempt <= max_attempts),
            max_attempts INTEGER NOT NULL CHECK (max_attempts >= 1),
            lease_epoch INTEGER NOT NULL,
            fencing_token INTEGER NOT NULL,
            lease_owner TEXT,
            lease_expires_at REAL,
            not_before REAL,
            idempotency_key TEXT,
            depends_on TEXT NOT NULL,
            pending_deps INTEGER NOT NULL,
            fairness_group TEXT,
            payload BLOB NOT NULL,
            payload_size INTEGER NOT NULL,
            payload_digest BLOB NOT NULL,
            outcome TEXT,
            error TEXT,
            commit_token INTEGER,
            last_dispatched_at REAL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            UNIQUE (tenant, idempotency_key)
        )""",
        # The claim order (priority, then age) with the claimable states as the index predicate.
        f"CREATE INDEX {T}_claim_queue ON {T} (queue, priority DESC, seq) WHERE {_ACTIVE}",
        f"CREATE INDEX {T}_claim_any ON {T} (priority DESC, seq) WHERE {_ACTIVE}",
        f"CREATE INDEX {T}_leases ON {T} (lease_expires_at) WHERE state IN ('leased', 'running')",
        f"CREATE INDEX {T}_dispatch ON {T} (last_dispatched_at) WHERE state = 'ready'",
        f"CREATE INDEX {T}_deadline ON {T} (deadline) WHERE deadline IS NOT NULL AND {_NON_TERMINAL}",
        f"CREATE INDEX {T}_tenant ON {T} (tenant, seq)",
        f"""CREATE TABLE {DEPS} (
            dependency TEXT NOT NULL,
            dependent TEXT NOT NULL,
            PRIMARY KEY (dependency, dependent)
        ) WITHOUT ROWID""",
        f"""CREATE TABLE {OUTCOMES} (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            work_item_id TEXT NOT NULL,
            tenant TEXT NOT NULL,
            event TEXT NOT NULL,
            owner TEXT,
            lease_epoch INTEGER NOT NULL,
            fencing_token INTEGER NOT NULL,
            at REAL NOT NULL,
            outcome TEXT,
            detail TEXT
        )""",
        f"CREATE INDEX {OUTCOMES}_item ON {OUTCOMES} (work_item_id, seq)",
        # Append-only in the database too, not just by convention in this code.
        f"""CREATE TRIGGER {OUTCOMES}_no_update BEFORE UPDATE ON {OUTCOMES}
            BEGIN SELECT RAISE(ABORT, 'outcome records are append-only'); END""",
        f"""CREATE TRIGGER {OUTCOMES}_no_delete BEFORE DELETE ON {OUTCOMES}
            BEGIN SELECT RAISE(ABORT, 'outcome records are append-only'); END""",
    ),
}

_COLUMNS: Final = ", ".join(ROW_FIELDS)
_INSERT_FIELDS: Final = tuple(f for f in ROW_FIELDS if f != "seq")
_INSERT: Final = f"INSERT INTO {T} ({', '.join(_INSERT_FIELDS)}, payload) VALUES ({', '.join('?' * (len(_INSERT_FIELDS) + 1))})"
_UPDATE_FIELDS: Final = tuple(f for f in ROW_FIELDS if f not in {"seq", "id"})
_UPDATE: Final = f"UPDATE {T} SET {', '.join(f'{f} = ?' for f in _UPDATE_FIELDS)} WHERE id = ?"
_CLAIMABLE: Final = (
    f"{_ACTIVE} AND CASE WHEN state = 'ready' THEN coalesce(not_before <= :now, 1)"
    " ELSE lease_expires_at <= :now END"
)
# SQLite's clock in unix seconds (julianday has millisecond resolution).
_NOW: Final = "SELECT (julianday('now') - 2440587.5) * 86400.0"


def _to_db(name: str, value: Any) -> Any:
    if name == "depends_on":
        return json.dumps(list(value))
    if name in {"state", "outcome"} and value is not None:
        return str(value.value)
    return value


def _row(rec: sqlite3.Row) -> Row:
    data = dict(zip(ROW_FIELDS, rec, strict=True))
    data["state"] = WorkState(data["state"])
    data["outcome"] = None if data["outcome"] is None else Outcome(data["outcome"])
    data["depends_on"] = tuple(json.loads(data["depends_on"]))
    data["payload_digest"] = bytes(data["payload_digest"])
    return Row(**data)


class _SqliteTx:
    def __init__(self, conn: sqlite3.Connection, now: float) -> None:
        self.conn = conn
        self.now = now

    def _rows(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> list[Row]:
        return [_row(rec) for rec in self.conn.execute(sql, params).fetchall()]

    def load(self, work_item_id: str) -> Row | None:
        rows = self._rows(f"SELECT {_COLUMNS} FROM {T} WHERE id = ?", (work_item_id,))
        return rows[0] if rows else None

    def load_by_key(self, tenant: str, idempotency_key: str) -> Row | None:
        rows = self._rows(
            f"SELECT {_COLUMNS} FROM {T} WHERE tenant = ? AND idempotency_key = ?", (tenant, idempotency_key)
        )
        return rows[0] if rows else None

    def insert(self, row: Row, payload: bytes) -> None:
        values = [_to_db(name, getattr(row, name)) for name in _INSERT_FIELDS]
        cursor = self.conn.execute(_INSERT, [*values, payload])
        assert cursor.lastrowid is not None
        row.seq = cursor.lastrowid

    def save(self, row: Row) -> None:
        values = [_to_db(name, getattr(row, name)) for name in _UPDATE_FIELDS]
        self.conn.execute(_UPDATE, [*values, row.id])

    def link(self, dependent: str, dependencies: Sequence[str]) -> None:
        self.conn.executemany(
            f"INSERT INTO {DEPS} (dependency, dependent) VALUES (?, ?)",
            [(dep, dependent) for dep in dependencies],
        )

    def dependents(self, work_item_id: str) -> list[str]:
        rows = self.conn.execute(f"SELECT dependent FROM {DEPS} WHERE dependency = ?", (work_item_id,))
        return [str(rec[0]) for rec in rows.fetchall()]

    def first_claimable(self, queue: str | None, tenant: str | None) -> Row | None:
        where = [_CLAIMABLE]
        if queue is not None:
            where.append("queue = :queue")
        if tenant is not None:
            where.append("tenant = :tenant")
        rows = self._rows(
            f"SELECT {_COLUMNS} FROM {T} WHERE {' AND '.join(where)} ORDER BY priority DESC, seq LIMIT 1",
            {"now": self.now, "queue": queue, "tenant": tenant},
        )
        return rows[0] if rows else None

    def overdue(self, limit: int) -> list[Row]:
        return self._rows(
            f"SELECT {_COLUMNS} FROM {T} WHERE deadline IS NOT NULL AND {_NON_TERMINAL} AND deadline <= ?"
            " ORDER BY deadline, seq LIMIT ?",
            (self.now, limit),
        )

    def recoverable(self, stale_before: float, limit: int) -> list[Row]:
        expired = self._rows(
            f"SELECT {_COLUMNS} FROM {T} WHERE state IN ('leased', 'running') AND lease_expires_at <= ?"
            " ORDER BY lease_expires_at, seq LIMIT ?",
            (self.now, limit),
        )
        stale = self._rows(
            f"SELECT {_COLUMNS} FROM {T} WHERE state = 'ready'"
            " AND (last_dispatched_at IS NULL OR last_dispatched_at <= ?)"
            " AND (not_before IS NULL OR not_before <= ?) ORDER BY last_dispatched_at, seq LIMIT ?",
            (stale_before, self.now, limit),
        )
        return [*expired, *stale][:limit]

    def touch_dispatched(self, work_item_ids: Sequence[str]) -> None:
        self.conn.executemany(
            f"UPDATE {T} SET last_dispatched_at = ? WHERE id = ?", [(self.now, i) for i in work_item_ids]
        )

    def next_token(self) -> int:
        rec = self.conn.execute(
            f"UPDATE {COUNTERS} SET value = value + 1 WHERE name = 'fencing_token' RETURNING value"
        ).fetchone()
        return int(rec[0])

    def append(self, record: OutcomeRecord) -> None:
        self.conn.execute(
            f"INSERT INTO {OUTCOMES} ({OUTCOME_SELECT}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                record.work_item_id,
                record.tenant,
                record.event,
                record.owner,
                record.lease_epoch,
                record.fencing_token,
                record.at.timestamp(),
                record.outcome,
                record.detail,
            ),
        )

    def outcomes(self, work_item_id: str) -> list[OutcomeRecord]:
        rows = self.conn.execute(
            f"SELECT {OUTCOME_SELECT} FROM {OUTCOMES} WHERE work_item_id = ? ORDER BY seq", (work_item_id,)
        ).fetchall()
        result = []
        for item_id, tenant, event, owner, epoch, token, at, outcome, detail in rows:
            when = to_dt(at)
            assert when is not None
            result.append(OutcomeRecord(item_id, tenant, event, owner, epoch, token, when, outcome, detail))
        return result

    def payload(self, work_item_id: str) -> bytes | None:
        rec = self.conn.execute(f"SELECT payload FROM {T} WHERE id = ?", (work_item_id,)).fetchone()
        return None if rec is None else bytes(rec[0])

    def list_items(
        self, tenant: str, states: Sequence[WorkState], limit: int, after: str | None
    ) -> list[Row]:
        where = ["tenant = ?"]
        params: list[Any] = [tenant]
        if states:
            where.append(f"state IN ({', '.join('?' * len(states))})")
            params.extend(state.value for state in states)
        if after is not None:
            where.append(f"seq < (SELECT seq FROM {T} WHERE id = ? AND tenant = ?)")
            params.extend([after, tenant])
        return self._rows(
            f"SELECT {_COLUMNS} FROM {T} WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT ?",
            [*params, limit],
        )


class SqliteStore(EngineStore):
    """WorkItemStore on one SQLite file (shared safely by threads and local processes)."""

    BUSY_TIMEOUT_S: Final = 30.0

    def __init__(self, path: Path | str, settings: Settings | None = None) -> None:
        super().__init__(Limits.of(settings or load_settings()))
        self.path = Path(path)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[sqlite3.Connection] = []
        self._schema_ok = False
        self._clock_offset_s = 0.0
        self._leaders: dict[str, int] = {}
        self._closed = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._connection()
        except (OSError, sqlite3.Error) as exc:
            raise BackendUnavailable(f"SQLite database cannot be opened: {exc}") from exc

    # --- connections and transactions --------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        if self._closed:
            raise BackendUnavailable("the SQLite store is closed")
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        conn = sqlite3.connect(
            self.path, timeout=self.BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
        conn.execute("PRAGMA foreign_keys=ON")
        self._local.conn = conn
        with self._lock:
            self._connections.append(conn)
        return conn

    def set_clock_offset_for_tests(self, seconds: float) -> None:
        """Test hook: shift this store's reading of the SQLite clock by ``seconds``."""
        self._clock_offset_s = float(seconds)

    def _now(self, conn: sqlite3.Connection) -> float:
        return float(conn.execute(_NOW).fetchone()[0]) + self._clock_offset_s

    @contextmanager
    def _transaction(self, begin: str) -> Iterator[_SqliteTx]:
        conn = self._connection()
        self._check_schema(conn)
        try:
            conn.execute(begin)
        except sqlite3.OperationalError as exc:
            raise BackendUnavailable(f"SQLite is busy or unavailable: {exc}") from exc
        try:
            yield _SqliteTx(conn, self._now(conn))
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _write(self) -> contextlib.AbstractContextManager[_SqliteTx]:
        return self._transaction("BEGIN IMMEDIATE")

    def _read(self) -> contextlib.AbstractContextManager[_SqliteTx]:
        return self._transaction("BEGIN")

    # --- schema ------------------------------------------------------------------------------------------

    def _version(self, conn: sqlite3.Connection) -> int:
        exists = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (VERSIONS,)
        ).fetchone()
        if exists is None:
            return 0
        rec = conn.execute(
            f"SELECT max(version) FROM {VERSIONS} WHERE component = ?", (COMPONENT,)
        ).fetchone()
        return int(rec[0] or 0)

    def _check_schema(self, conn: sqlite3.Connection) -> None:
        if self._schema_ok:
            return
        version = self._version(conn)
        if version < SCHEMA_VERSION:
            raise SchemaOutdated(
                f"the WorkItem schema in the SQLite database is at version {version}; this code needs "
                f"{SCHEMA_VERSION}: {MIGRATE_HINT}"
            )
        self._schema_ok = True

    def migrate(self) -> int:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")  # one migrator at a time, all or nothing
        try:
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {VERSIONS} (component TEXT NOT NULL, version INTEGER NOT NULL,"
                " applied_at REAL NOT NULL, PRIMARY KEY (component, version))"
            )
            current = self._version(conn)
            for version in sorted(v for v in MIGRATIONS if v > current):
                for statement in MIGRATIONS[version]:
                    conn.execute(statement)
                conn.execute(
                    f"INSERT INTO {VERSIONS} (component, version, applied_at) VALUES (?, ?, ?)",
                    (COMPONENT, version, self._now(conn)),
                )
                current = version
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        self._schema_ok = current >= SCHEMA_VERSION
        return current

    # --- one transaction with the queue (the enqueue path, agent_dispatch.dispatch) ----------------------

    @property
    def database_identity(self) -> str:
        """Which database file this store writes; the enqueue path compares it with the transport's."""
        return f"sqlite:{self.path.resolve()}"

    def submit_in_transaction(
        self,
        request: SubmitRequest,
        then: Callable[[sqlite3.Connection, WorkItem], None],
        *,
        dispatched: bool = False,
    ) -> SubmitResult:
        """``submit``, then ``then(conn, item)`` for a newly created item in the SAME transaction.

        The queue in the same file admits the item's envelope there: if ``then`` raises, the
        WorkItem is rolled back with it, so a refused admission leaves no orphan. ``dispatched``:
        ``then`` admits a created ``ready`` item, so its dispatch time is recorded in the same
        transaction.
        """
        prepared = prepare_submit(request, self.limits)
        with self._write() as tx:
            result = self._submit_tx(tx, prepared)
            if result.created:
                then(tx.conn, result.item)
                if dispatched and result.item.state is WorkState.READY:
                    tx.touch_dispatched([result.item.id])
            return result

    def submit_many_in_transaction(
        self,
        requests: Sequence[SubmitRequest],
        then: Callable[[sqlite3.Connection, list[WorkItem]], None],
        *,
        dispatched: bool = False,
    ) -> list[SubmitResult | DispatchError]:
        """``submit`` for a batch in ONE write transaction, then ``then(conn, created_items)`` in it.

        As :meth:`PostgresStore.submit_many_in_transaction`: requests without dependencies, each
        answered in order (a repeat is ``created=False``, a conflict its error); if ``then``
        raises, nothing of the batch is kept.
        """
        prepared, refused = prepare_batch(requests, self.limits)
        outcomes: dict[int, SubmitResult | DispatchError] = dict(refused)
        with self._write() as tx:
            created: list[WorkItem] = []
            for index, item in prepared:
                try:
                    result = self._submit_tx(tx, item)  # a refusal is decided before any write
                except DispatchError as exc:
                    outcomes[index] = exc
                    continue
                outcomes[index] = result
                if result.created:
                    created.append(result.item)
            then(tx.conn, created)
            if dispatched:
                tx.touch_dispatched([item.id for item in created if item.state is WorkState.READY])
        return [outcomes[i] for i in range(len(requests))]

    # --- leader election ---------------------------------------------------------------------------------

    def try_lead(self, name: str) -> bool:
        """An exclusive ``flock`` on a file beside the database, held while this store leads."""
        with self._lock:
            if name in self._leaders:
                return True
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
            lock_path = self.path.with_name(f"{self.path.name}.{safe}.lock")
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            self._leaders[name] = fd
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fd in self._leaders.values():
                os.close(fd)  # closing the descriptor releases the flock
            self._leaders.clear()
            connections, self._connections = self._connections, []
        for conn in connections:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        self._local = threading.local()
