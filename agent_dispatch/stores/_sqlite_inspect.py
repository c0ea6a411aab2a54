"""The SQLite store's queries for the web UI (``Inspectable``), mixed into its transaction class.

Each is bounded by an index or a ``LIMIT``: held leases read the lease-expiry index, events the
outcome log's primary key from a position on. A tenants page counts its tenants' rows (a local
store is small; PostgreSQL keeps per-tenant counters instead).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any, Final

from agent_dispatch.models import OutcomeRecord
from agent_dispatch.stores._calls import Listing
from agent_dispatch.stores._common import OUTCOME_SELECT, to_dt
from agent_dispatch.stores._engine_rows import ROW_FIELDS, Row

T: Final = "agent_dispatch_work_items"
OUTCOMES: Final = "agent_dispatch_outcomes"
_COLUMNS: Final = ", ".join(ROW_FIELDS)


def _ts(value: Any) -> float | None:
    when = to_dt(value)
    return None if when is None else when.timestamp()


class SqliteInspectTx:
    """Mixed into the SQLite transaction: ``conn`` and ``_rows`` come from there."""

    conn: sqlite3.Connection

    def _rows(self, sql: str, params: Sequence[Any]) -> list[Row]:
        raise NotImplementedError

    def flush_outcomes(self) -> None:
        """Write the outcome records appended so far in this transaction."""

    def browse(self, page: Listing) -> list[Row]:
        tenant, states = page.tenant, page.states
        where: list[str] = []
        params: list[Any] = []
        for column, value in (("tenant", tenant), ("kind", page.kind), ("session_id", page.session_id)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if states:
            where.append(f"state IN ({', '.join('?' * len(states))})")
            params.extend(state.value for state in states)
        if page.after is not None:
            # An anchor the caller may not see matches no seq: ``seq < NULL`` is never true.
            scope = " AND tenant = ?" if tenant is not None else ""
            where.append(f"seq < (SELECT seq FROM {T} WHERE id = ?{scope})")
            params.extend([page.after] + ([tenant] if tenant is not None else []))
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        return self._rows(
            f"SELECT {_COLUMNS} FROM {T} {clause} ORDER BY seq DESC LIMIT ?", [*params, page.limit]
        )

    def tenant_stats(
        self, after: str, limit: int, tenants: list[str] | None
    ) -> list[tuple[str, int, int, int, float | None, float | None]]:
        # A local store is small: its rows are counted (PostgreSQL keeps counters instead).
        self.flush_outcomes()
        scope, params = "", [after]
        if tenants is not None:
            scope = f" AND tenant IN ({', '.join('?' * len(tenants))})"
            params.extend(tenants)
        names = [
            str(r[0])
            for r in self.conn.execute(
                f"SELECT DISTINCT tenant FROM {T} WHERE tenant > ?{scope} ORDER BY tenant LIMIT ?",
                (*params, limit),
            )
        ]
        result = []
        for name in names:
            q, r, d, oldest = self.conn.execute(
                f"SELECT coalesce(sum(state IN ('submitted', 'ready')), 0),"
                f" coalesce(sum(state IN ('leased', 'running')), 0),"
                f" coalesce(sum(state NOT IN ('submitted', 'ready', 'leased', 'running')), 0),"
                f" min(CASE WHEN state IN ('submitted', 'ready') THEN created_at END)"
                f" FROM {T} WHERE tenant = ?",
                (name,),
            ).fetchone()
            (served,) = self.conn.execute(
                f"SELECT max(at) FROM {OUTCOMES} WHERE tenant = ? AND event = 'claim'", (name,)
            ).fetchone()
            result.append(
                (name, int(q), int(r), int(d), None if oldest is None else float(oldest), _ts(served))
            )
        return result

    def held(self, limit: int) -> list[Row]:
        return self._rows(
            f"SELECT {_COLUMNS} FROM {T} WHERE state IN ('leased', 'running')"
            f" ORDER BY lease_expires_at, seq LIMIT ?",
            [limit],
        )

    def events_after(self, seq: int, limit: int) -> list[tuple[int, OutcomeRecord]]:
        self.flush_outcomes()
        if seq < 0:
            sql = f"SELECT seq, {OUTCOME_SELECT} FROM {OUTCOMES} ORDER BY seq DESC LIMIT 1"
            rows = self.conn.execute(sql).fetchall()
        else:
            sql = f"SELECT seq, {OUTCOME_SELECT} FROM {OUTCOMES} WHERE seq > ? ORDER BY seq LIMIT ?"
            rows = self.conn.execute(sql, (seq, limit)).fetchall()
        result = []
        for n, item_id, tenant, event, owner, epoch, token, at, outcome, detail in rows:
            when = to_dt(at)
            assert when is not None
            record = OutcomeRecord(item_id, tenant, event, owner, epoch, token, when, outcome, detail)
            result.append((int(n), record))
        return result
