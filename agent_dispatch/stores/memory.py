"""The in-memory WorkItem store: for unit tests only (settings can never select it).

One lock serialises every transaction; a transaction that raises is undone from an undo log, so
a refused call leaves nothing behind, as in the database-backed stores. The clock is injectable
so tests can move time (lease expiry, backoff, deadlines) without sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from agent_dispatch.models import LEASED_STATES, OutcomeRecord, WorkState
from agent_dispatch.settings import Settings
from agent_dispatch.settings import load as load_settings
from agent_dispatch.store import SCHEMA_VERSION
from agent_dispatch.stores._calls import Listing
from agent_dispatch.stores._common import Limits
from agent_dispatch.stores._engine import EngineStore
from agent_dispatch.stores._engine_rows import Row

_MISSING: Any = object()


class _Tables:
    def __init__(self) -> None:
        self.items: dict[str, Row] = {}
        self.payloads: dict[str, bytes] = {}
        self.keys: dict[tuple[str, str], str] = {}
        self.dependents: dict[str, list[str]] = {}
        self.outcomes: dict[str, list[OutcomeRecord]] = {}
        #: Every record in append order (its index + 1 is its seq), for ``events_after``.
        self.events: list[OutcomeRecord] = []
        self.token = 0
        self.seq = 0


class _MemoryTx:
    """Writes go straight to the tables; each one logs how to undo it."""

    def __init__(self, tables: _Tables, now: float) -> None:
        self.t = tables
        self.now = now
        self._undo: list[Callable[[], None]] = []

    def _put(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        old = table.get(key, _MISSING)

        def undo() -> None:
            if old is _MISSING:
                table.pop(key, None)
            else:
                table[key] = old

        self._undo.append(undo)
        table[key] = value

    def rollback(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def load(self, work_item_id: str) -> Row | None:
        row = self.t.items.get(work_item_id)
        return None if row is None else row.copy()

    def load_by_key(self, tenant: str, idempotency_key: str) -> Row | None:
        item_id = self.t.keys.get((tenant, idempotency_key))
        return None if item_id is None else self.load(item_id)

    def insert(self, row: Row, payload: bytes) -> None:
        old_seq = self.t.seq

        def undo_seq() -> None:
            self.t.seq = old_seq

        self._undo.append(undo_seq)
        self.t.seq += 1
        row.seq = self.t.seq
        self._put(self.t.items, row.id, row.copy())
        self._put(self.t.payloads, row.id, payload)
        if row.idempotency_key is not None:
            self._put(self.t.keys, (row.tenant, row.idempotency_key), row.id)

    def save(self, row: Row) -> None:
        self._put(self.t.items, row.id, row.copy())

    def link(self, dependent: str, dependencies: Sequence[str]) -> None:
        for dep in dependencies:
            self._put(self.t.dependents, dep, [*self.t.dependents.get(dep, []), dependent])

    def dependents(self, work_item_id: str) -> list[str]:
        return list(self.t.dependents.get(work_item_id, []))

    def unfinished(self) -> int:
        # The in-memory reference implementation keeps no O(1) count (the database stores' is
        # kept by triggers): it counts its rows, under the one lock of the write transaction.
        return sum(not row.state.terminal for row in self.t.items.values())

    def _claimable(self, row: Row) -> bool:
        if row.state is WorkState.READY:
            return row.not_before is None or row.not_before <= self.now
        return (
            row.state in LEASED_STATES
            and row.lease_expires_at is not None
            and row.lease_expires_at <= self.now
        )

    def first_claimable(self, queue: str | None, tenant: str | None) -> Row | None:
        candidates = [
            row
            for row in self.t.items.values()
            if (queue is None or row.queue == queue)
            and (tenant is None or row.tenant == tenant)
            and self._claimable(row)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda row: (-row.priority, row.seq)).copy()

    def overdue(self, limit: int) -> list[Row]:
        rows = [
            row
            for row in self.t.items.values()
            if not row.state.terminal and row.deadline is not None and row.deadline <= self.now
        ]
        rows.sort(key=lambda row: (row.deadline or 0.0, row.seq))
        return [row.copy() for row in rows[:limit]]

    def recoverable(self, stale_before: float, limit: int) -> list[Row]:
        expired = [
            row
            for row in self.t.items.values()
            if row.state in LEASED_STATES
            and row.lease_expires_at is not None
            and row.lease_expires_at <= self.now
        ]
        stale = [
            row
            for row in self.t.items.values()
            if row.state is WorkState.READY
            and (row.not_before is None or row.not_before <= self.now)
            and (row.last_dispatched_at is None or row.last_dispatched_at <= stale_before)
        ]
        expired.sort(key=lambda row: (row.lease_expires_at or 0.0, row.seq))
        # Longest without a delivery first (never dispatched counts as oldest).
        stale.sort(key=lambda row: (row.last_dispatched_at or float("-inf"), row.seq))
        return [row.copy() for row in [*expired, *stale][:limit]]

    def touch_dispatched(self, work_item_ids: Sequence[str]) -> None:
        for item_id in work_item_ids:
            row = self.load(item_id)
            if row is not None:
                row.last_dispatched_at = self.now
                self.save(row)

    def next_token(self) -> int:
        old = self.t.token

        def undo() -> None:
            self.t.token = old

        self._undo.append(undo)
        self.t.token += 1
        return self.t.token

    def append(self, record: OutcomeRecord) -> None:
        self._put(
            self.t.outcomes, record.work_item_id, [*self.t.outcomes.get(record.work_item_id, []), record]
        )
        events = self.t.events
        events.append(record)
        self._undo.append(lambda: events.__delitem__(-1))

    def outcomes(self, work_item_id: str) -> list[OutcomeRecord]:
        return list(self.t.outcomes.get(work_item_id, []))

    def payload(self, work_item_id: str) -> bytes | None:
        return self.t.payloads.get(work_item_id)

    def browse(self, page: Listing) -> list[Row]:
        tenant, states, kind, session_id = page.tenant, page.states, page.kind, page.session_id
        rows = [
            row
            for row in self.t.items.values()
            if (tenant is None or row.tenant == tenant)
            and (not states or row.state in states)
            and (kind is None or row.kind == kind)
            and (session_id is None or row.session_id == session_id)
        ]
        rows.sort(key=lambda row: row.seq, reverse=True)
        if page.after is not None:
            anchor = self.t.items.get(page.after)
            if anchor is None or (tenant is not None and anchor.tenant != tenant):
                return []
            rows = [row for row in rows if row.seq < anchor.seq]
        return [row.copy() for row in rows[: page.limit]]

    def tenant_stats(
        self, after: str, limit: int, tenants: list[str] | None
    ) -> list[tuple[str, int, int, int, float | None, float | None]]:
        wanted = None if tenants is None else set(tenants)
        stats: dict[str, list[Any]] = {}
        for row in self.t.items.values():
            if row.tenant <= after or (wanted is not None and row.tenant not in wanted):
                continue
            entry = stats.setdefault(row.tenant, [0, 0, 0, None, None])
            if row.state.terminal:
                entry[2] += 1
            elif row.state in LEASED_STATES:
                entry[1] += 1
            else:
                entry[0] += 1
                entry[3] = row.created_at if entry[3] is None else min(entry[3], row.created_at)
        for record in self.t.events:
            found = stats.get(record.tenant)
            if found is not None and record.event == "claim":
                at = record.at.timestamp()
                found[4] = at if found[4] is None else max(found[4], at)
        return [(t, *stats[t]) for t in sorted(stats)[:limit]]

    def held(self, limit: int) -> list[Row]:
        rows = [row for row in self.t.items.values() if row.state in LEASED_STATES]
        rows.sort(key=lambda row: (row.lease_expires_at or 0.0, row.seq))
        return [row.copy() for row in rows[:limit]]

    def events_after(self, seq: int, limit: int) -> list[tuple[int, OutcomeRecord]]:
        events = self.t.events
        start = max(len(events) - 1, 0) if seq < 0 else seq
        return [(n + 1, events[n]) for n in range(start, min(len(events), start + limit))]


class MemoryStore(EngineStore):
    """In-process WorkItemStore. ``clock`` returns unix seconds; tests pass a controllable one."""

    def __init__(self, settings: Settings | None = None, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__(Limits.of(settings or load_settings()))
        self._clock = clock
        self._lock = threading.RLock()
        self._tables = _Tables()
        self._leaders: set[str] = set()

    @contextmanager
    def _write(self) -> Iterator[_MemoryTx]:
        with self._lock:
            tx = _MemoryTx(self._tables, self._clock())
            try:
                yield tx
            except BaseException:
                tx.rollback()
                raise

    def _read(self) -> AbstractContextManager[_MemoryTx]:
        return self._write()

    def migrate(self) -> int:
        return SCHEMA_VERSION

    def try_lead(self, name: str) -> bool:
        # One process, one store: whoever asks through this instance leads.
        with self._lock:
            self._leaders.add(name)
            return True

    def close(self) -> None:
        with self._lock:
            self._leaders.clear()
