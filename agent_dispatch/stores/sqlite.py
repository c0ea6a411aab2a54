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
import functools
import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Final

from agent_dispatch.db import sql
from agent_dispatch.db.migrate import ComponentVersions, Schema, apply, require
from agent_dispatch.db.sqlite import ThreadConnections
from agent_dispatch.errors import BackendUnavailable, DispatchError, QueueFull
from agent_dispatch.models import (
    CommitResult,
    Lease,
    Outcome,
    OutcomeRecord,
    SubmitRequest,
    SubmitResult,
    WorkItem,
    WorkState,
)
from agent_dispatch.settings import Settings
from agent_dispatch.settings import load as load_settings
from agent_dispatch.store import SCHEMA_VERSION, StartedTurn
from agent_dispatch.stores import _sqlite_batch
from agent_dispatch.stores._common import (
    COMPONENT,
    MIGRATE_HINT,
    OUTCOME_SELECT,
    Limits,
    prepare_batch,
    prepare_submit,
    to_dt,
)
from agent_dispatch.stores._engine import EngineStore
from agent_dispatch.stores._engine_rows import ROW_FIELDS, Row, Tx
from agent_dispatch.stores._release import dispatch_released
from agent_dispatch.stores._sqlite_inspect import SqliteInspectTx

T: Final = "agent_dispatch_work_items"
DEPS: Final = "agent_dispatch_dependencies"
OUTCOMES: Final = "agent_dispatch_outcomes"
COUNTERS: Final = "agent_dispatch_counters"

_NON_TERMINAL: Final = "state IN ('submitted', 'ready', 'leased', 'running')"

#: The WorkItem schema on SQLite: ``sql/sqlite_v<N>.sql`` takes version N-1 to N.
SCHEMA: Final = Schema(
    title="the WorkItem schema in the SQLite database",
    version=SCHEMA_VERSION,
    record=ComponentVersions("sqlite", COMPONENT),
    steps={
        version: tuple(
            sql.load(__package__ or "agent_dispatch.stores", f"sql/sqlite_v{version}.sql").values()
        )
        for version in range(1, SCHEMA_VERSION + 1)
    },
    hint=MIGRATE_HINT,
)

_COLUMNS: Final = ", ".join(ROW_FIELDS)
_INSERT_FIELDS: Final = tuple(f for f in ROW_FIELDS if f != "seq")
_INSERT: Final = f"INSERT INTO {T} ({', '.join(_INSERT_FIELDS)}, payload) VALUES ({', '.join('?' * (len(_INSERT_FIELDS) + 1))})"
_UPDATE_FIELDS: Final = tuple(f for f in ROW_FIELDS if f not in {"seq", "id"})
#: Where each of ``_UPDATE_FIELDS`` sits in a row read as ``SELECT {_COLUMNS}``.
_UPDATE_POSITIONS: Final = tuple(ROW_FIELDS.index(f) for f in _UPDATE_FIELDS)
_DISPATCHED_AT: Final = _UPDATE_FIELDS.index("last_dispatched_at")


def _to_db(name: str, value: Any) -> Any:
    if name == "depends_on":
        return json.dumps(list(value))
    if name in {"state", "outcome"} and value is not None:
        return str(value.value)
    return value


@functools.cache
def _update_sql(columns: tuple[str, ...]) -> str:
    # A few shapes exist (one per lifecycle step), so the cache and sqlite3's statement cache stay small.
    return f"UPDATE {T} SET {', '.join(f'{c} = ?' for c in columns)} WHERE id = ?"


def _row(rec: sqlite3.Row) -> Row:
    data = dict(zip(ROW_FIELDS, rec, strict=True))
    data["state"] = WorkState(data["state"])
    data["outcome"] = None if data["outcome"] is None else Outcome(data["outcome"])
    data["depends_on"] = tuple(json.loads(data["depends_on"]))
    data["payload_digest"] = bytes(data["payload_digest"])
    return Row(**data)


def _unfinished(conn: sqlite3.Connection) -> int:
    """The counter the v2 triggers keep (they run with each statement, so it is current)."""
    rec = conn.execute(f"SELECT value FROM {COUNTERS} WHERE name = 'unfinished'").fetchone()
    assert rec is not None, "the unfinished counter has its row from the v2 migration on"
    return int(rec[0])


class _SqliteTx(SqliteInspectTx):
    def __init__(self, conn: sqlite3.Connection, now: float) -> None:
        self.conn = conn
        self.now = now
        # The stored values (``_UPDATE_FIELDS`` order) of each row this transaction read or wrote,
        # so ``save`` writes only the columns that changed: SQLite rewrites every index that has
        # a column in an UPDATE's SET list (or its WHERE clause), changed or not, and a full-row
        # SET wrote all eight indexes of the table on every lifecycle step.
        self._stored: dict[str, list[Any]] = {}
        self._appended: list[tuple[Any, ...]] = []

    def _rows(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> list[Row]:
        rows = []
        for rec in self.conn.execute(sql, params).fetchall():
            row = _row(rec)
            self._stored[row.id] = [rec[i] for i in _UPDATE_POSITIONS]
            rows.append(row)
        return rows

    def unfinished(self) -> int:
        return _unfinished(self.conn)

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
        stored = self._stored.get(row.id)
        if stored is None:
            changed = list(range(len(values)))
        else:
            changed = [i for i, (new, old) in enumerate(zip(values, stored, strict=True)) if new != old]
            if not changed:
                return
        self.conn.execute(
            _update_sql(tuple(_UPDATE_FIELDS[i] for i in changed)), [*(values[i] for i in changed), row.id]
        )
        self._stored[row.id] = values

    def link(self, dependent: str, dependencies: Sequence[str]) -> None:
        self.conn.executemany(
            f"INSERT INTO {DEPS} (dependency, dependent) VALUES (?, ?)",
            [(dep, dependent) for dep in dependencies],
        )

    def dependents(self, work_item_id: str) -> list[str]:
        rows = self.conn.execute(f"SELECT dependent FROM {DEPS} WHERE dependency = ?", (work_item_id,))
        return [str(rec[0]) for rec in rows.fetchall()]

    def first_claimable(self, queue: str | None, tenant: str | None) -> Row | None:
        where = [_sqlite_batch.CLAIMABLE]
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
        for work_item_id in work_item_ids:
            stored = self._stored.get(work_item_id)
            if stored is not None:
                stored[_DISPATCHED_AT] = self.now

    def next_token(self) -> int:
        rec = self.conn.execute(
            f"UPDATE {COUNTERS} SET value = value + 1 WHERE name = 'fencing_token' RETURNING value"
        ).fetchone()
        return int(rec[0])

    def append(self, record: OutcomeRecord) -> None:
        # Written in one executemany before the transaction commits (or anything reads them back).
        self._appended.append(
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
            )
        )

    def flush_outcomes(self) -> None:
        if self._appended:
            self.conn.executemany(
                f"INSERT INTO {OUTCOMES} ({OUTCOME_SELECT}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                self._appended,
            )
            self._appended.clear()

    def outcomes(self, work_item_id: str) -> list[OutcomeRecord]:
        self.flush_outcomes()
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


@contextmanager
def _savepoint(conn: sqlite3.Connection) -> Iterator[None]:
    """A savepoint inside the open transaction: rolled back alone if the block raises."""
    conn.execute("SAVEPOINT dispatch_released")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK TO SAVEPOINT dispatch_released")
        conn.execute("RELEASE SAVEPOINT dispatch_released")
        raise
    conn.execute("RELEASE SAVEPOINT dispatch_released")


class SqliteStore(EngineStore):
    """WorkItemStore on one SQLite file (shared safely by threads and local processes)."""

    #: Class-level so a test can pose as newer code (see tests/contract).
    schema: Schema = SCHEMA

    def __init__(self, path: Path | str, settings: Settings | None = None) -> None:
        super().__init__(Limits.of(settings or load_settings()))
        self.path = Path(path)
        self._db = ThreadConnections(self.path, "SQLite store")
        self._lock = threading.Lock()
        self._schema_ok = False
        self._clock_offset_s = 0.0
        self._leaders: dict[str, int] = {}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._db.use():
                pass
        except (OSError, sqlite3.Error) as exc:
            raise BackendUnavailable(f"SQLite database cannot be opened: {exc}") from exc

    # --- transactions --------------------------------------------------------------------------------

    def set_clock_offset_for_tests(self, seconds: float) -> None:
        """Test hook: shift this store's reading of the SQLite clock by ``seconds``."""
        self._clock_offset_s = float(seconds)

    @contextmanager
    def _transaction(self, begin: str) -> Iterator[_SqliteTx]:
        if not self._schema_ok:
            with self._db.use() as conn:
                require(conn, self.schema)
            self._schema_ok = True
        with self._db.transaction(begin) as conn:
            tx = _SqliteTx(conn, self._db.now(conn) + self._clock_offset_s)
            yield tx
            tx.flush_outcomes()

    def _write(self) -> contextlib.AbstractContextManager[_SqliteTx]:
        return self._transaction("BEGIN IMMEDIATE")

    def _read(self) -> contextlib.AbstractContextManager[_SqliteTx]:
        return self._transaction("BEGIN")

    def migrate(self) -> int:
        with self._db.transaction() as conn:  # one migrator at a time, all or nothing
            version = apply(conn, self.schema)
        self._schema_ok = True
        return version

    # --- one transaction with the queue (the enqueue path, agent_dispatch.dispatch) ----------------------

    @property
    def database_identity(self) -> str:
        """Which database file this store writes; the enqueue path compares it with the transport's."""
        return f"sqlite:{self.path.resolve()}"

    def unfinished(self) -> int:
        """How many WorkItems are unfinished (the counter the v2 triggers keep)."""
        with self._read() as tx:
            return tx.unfinished()

    def admit_unfinished(self, conn: sqlite3.Connection, created: Sequence[WorkItem], bound: int) -> None:
        """Compare-and-admit inside a submit's write transaction (its ``then``): ``QueueFull`` when
        the new unfinished items take the count past ``bound``."""
        # The triggers counted the inserts already; the write lock makes the comparison atomic.
        new = sum(not item.state.terminal for item in created)
        if new and _unfinished(conn) > bound:
            raise QueueFull(f"{new} more unfinished turns would exceed the bound {bound}")

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
            result = self._submit_tx(tx, prepared, dispatched=dispatched)
            if result.created:
                then(tx.conn, result.item)
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
            new = _sqlite_batch.insert_new(tx, [item for _, item in prepared], dispatched=dispatched)
            if new is not None:
                created = new
                outcomes.update(
                    (index, SubmitResult(item, created=True))
                    for (index, _), item in zip(prepared, new, strict=True)
                )
            else:
                created = []
                for index, item in prepared:
                    try:
                        # A refusal is decided before any write.
                        result = self._submit_tx(tx, item, dispatched=dispatched)
                    except DispatchError as exc:
                        outcomes[index] = exc
                        continue
                    outcomes[index] = result
                    if result.created:
                        created.append(result.item)
            then(tx.conn, created)
        return [outcomes[i] for i in range(len(requests))]

    def commit_in_transaction(
        self,
        lease: Lease,
        outcome: Outcome,
        then: Callable[[sqlite3.Connection, list[WorkItem]], None],
        *,
        error: str | None = None,
    ) -> CommitResult:
        """``commit``; the dependents it releases are handed to ``then(conn, released)`` in the
        same write transaction (the queue in this file admits them there) and stamped dispatched.
        See :meth:`agent_dispatch.store.TransactionalCommit.commit_in_transaction`."""

        def in_commit(tx: Tx, released: list[WorkItem]) -> None:
            assert isinstance(tx, _SqliteTx)
            dispatch_released(partial(_savepoint, tx.conn), then, tx.conn, released, tx.touch_dispatched)

        return self._commit(lease, Outcome(outcome), error, in_commit)

    # --- a worker's batch, in set statements (see _sqlite_batch) ------------------------------------

    def _start_many(self, owner: str, wanted: list[tuple[str, str]], ttl: float) -> dict[str, StartedTurn]:
        with self._write() as tx:
            return _sqlite_batch.start_many(tx, owner, wanted, ttl)

    def _commit_many(self, wanted: list[tuple[Lease, Outcome, str | None]]) -> dict[str, WorkItem]:
        with self._write() as tx:
            return _sqlite_batch.commit_many(tx, wanted)

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
            for fd in self._leaders.values():
                os.close(fd)  # closing the descriptor releases the flock
            self._leaders.clear()
        self._db.close()
