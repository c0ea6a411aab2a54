"""The web UI's reads and the dead-letter retry (``Inspectable``) on PostgreSQL.

The statements live in ``sql/inspect.sql``; the rules match the engine stores'
(:mod:`agent_dispatch.stores._engine_inspect`), and the contract suite holds both to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from psycopg.rows import DictRow

from agent_dispatch.db import sql
from agent_dispatch.db.migrate import ComponentVersions, Schema, apply
from agent_dispatch.errors import DispatchError, InvalidTransition, NotFound
from agent_dispatch.models import WorkItem, WorkState
from agent_dispatch.store import SeqEvent, TenantStats, bound_error
from agent_dispatch.stores._calls import Listing
from agent_dispatch.stores._common import (
    DEPENDENCY_FAILED,
    ITEM_SELECT,
    MIGRATE_HINT,
    OUTCOME_SELECT,
    make_item,
    require_dt,
)
from agent_dispatch.stores.postgres._base import Conn, PostgresBase, outcome_record
from agent_dispatch.stores.postgres.statements import NOW, event_sql

_SQL: Final = sql.load(__package__ or "agent_dispatch.stores.postgres", "sql/inspect.sql")
_FIELDS: Final = {
    "now": NOW,
    "item": ITEM_SELECT,
    "return_item": ITEM_SELECT + ", has_dependents",
    "outcome_cols": OUTCOME_SELECT,
    "event": event_sql("'retry_dead_letter'", detail="%(reason)s"),
}


def _render(name: str, **fields: str) -> str:
    return _SQL[name].format(**_FIELDS, **fields)


BROWSE_AFTER: Final = _render("browse_after")
DEPENDENTS: Final = _render("dependents")
HELD: Final = _render("held")
EVENTS_AFTER: Final = _render("events_after")
NEWEST_EVENT: Final = _render("newest_event")
RETRY_DEAD_LETTER: Final = _render("retry_dead_letter")
TENANT_NAMES: Final = _render("tenant_names")
TENANT_STATS: Final = _render("tenant_stats")
TENANT_FOLD: Final = _render("tenant_fold")
#: Tenants one fold call compacts (the gateway's sampler calls it every few seconds).
FOLD_LIMIT: Final = 5000

#: The per-tenant counters: a schema component of its own beside the WorkItem schema, applied by
#: ``migrate`` after it (the triggers are on the WorkItem table).
TENANTS_SCHEMA: Final = Schema(
    title="the per-tenant counters in PostgreSQL",
    version=1,
    record=ComponentVersions("postgres", "work_items_tenants"),
    steps={1: (sql.read(__package__ or "agent_dispatch.stores.postgres", "sql/tenants_v1.sql"),)},
    lock_key=0x6164_6D69_6772_0002,
    hint=MIGRATE_HINT,
)
RETRY_DEAD_LETTER_DEPS: Final = _render("retry_dead_letter_deps")
DEPENDS_ON: Final = _render("depends_on")
FAILED_STATES: Final = frozenset(s.value for s in DEPENDENCY_FAILED)


def _event(rec: DictRow) -> SeqEvent:
    return SeqEvent(int(rec["seq"]), outcome_record(rec))


class Inspecting(PostgresBase):
    """``agent_dispatch.store.Inspectable`` for the PostgreSQL store."""

    def migrate(self) -> int:
        version = super().migrate()
        self._run(lambda conn: apply(conn, TENANTS_SCHEMA), check_schema=False)
        return version

    def _tenant_stats(self, after: str, limit: int, tenants: Sequence[str] | None) -> list[TenantStats]:
        def run(conn: Conn) -> list[DictRow]:
            names = (
                sorted(t for t in tenants if t > after)[:limit]
                if tenants is not None
                else [r["tenant"] for r in conn.execute(TENANT_NAMES, {"after": after, "limit": limit})]
            )
            return conn.execute(TENANT_STATS, {"tenants": names}).fetchall() if names else []

        rows = self._run(run, transaction=False)
        return [
            TenantStats(
                rec["tenant"],
                int(rec["queued"]),
                int(rec["running"]),
                int(rec["done"]),
                None if rec["oldest"] is None else require_dt(rec["oldest"]),
                None if rec["served_at"] is None else require_dt(rec["served_at"]),
            )
            for rec in rows
        ]

    def fold_tenant_counts(self) -> int:
        rec = self._run(lambda c: self._one(c, TENANT_FOLD, {"limit": FOLD_LIMIT}))
        return 0 if rec is None else int(rec["folded"])

    def _browse(self, page: Listing) -> list[WorkItem]:
        where = ["true"]
        params: dict[str, Any] = {"tenant": page.tenant, "limit": page.limit, "after": page.after}
        for column, value in (("tenant", page.tenant), ("kind", page.kind), ("session_id", page.session_id)):
            if value is not None:
                where.append(f"{column} = %({column})s")
                params[column] = value
        if page.states:
            where.append("state = ANY(%(states)s)")
            params["states"] = [s.value for s in page.states]
        if page.after is not None:
            where.append(BROWSE_AFTER)
        statement = _render("browse", where=" AND ".join(where))
        rows = self._run(lambda c: c.execute(statement, params).fetchall(), transaction=False)
        return [make_item(rec) for rec in rows]

    def dependents(self, work_item_id: str) -> list[str]:
        rows = self._run(lambda c: c.execute(DEPENDENTS, {"id": work_item_id}).fetchall(), transaction=False)
        return [str(rec["dependent"]) for rec in rows]

    def held_leases(self, *, limit: int = 200) -> list[WorkItem]:
        rows = self._run(lambda c: c.execute(HELD, {"limit": limit}).fetchall(), transaction=False)
        return [make_item(rec) for rec in rows]

    def events_after(self, seq: int, *, limit: int = 10000) -> list[SeqEvent]:
        if seq < 0:
            rows = self._run(lambda c: c.execute(NEWEST_EVENT).fetchall(), transaction=False)
        else:
            params = {"seq": seq, "limit": limit}
            rows = self._run(lambda c: c.execute(EVENTS_AFTER, params).fetchall(), transaction=False)
        return [_event(rec) for rec in rows]

    def retry_dead_letter(
        self, work_item_id: str, *, tenant: str | None, reason: str, bound: int | None = None
    ) -> WorkItem:
        params = self._p(id=work_item_id, tenant=tenant, reason=bound_error(reason))

        def refuse(conn: Conn) -> DispatchError:
            view = self._view(conn, work_item_id)
            if view is None or (tenant is not None and view.tenant != tenant):
                return NotFound(f"work item {work_item_id} not found")
            return InvalidTransition(f"work item {work_item_id} is {view.state.value}, not dead_letter")

        def run(conn: Conn) -> WorkItem:
            rec = self._one(conn, DEPENDS_ON, params)
            if rec is None:
                raise refuse(conn)
            depends_on = list(rec["depends_on"])
            locked = (
                conn.execute(RETRY_DEAD_LETTER_DEPS, {"deps": depends_on}).fetchall() if depends_on else []
            )
            deps = {str(r["id"]): str(r["state"]) for r in locked}
            pending = 0
            for dep_id in depends_on:
                state = deps.get(dep_id)
                if state is None or state in FAILED_STATES:
                    ended = "is gone" if state is None else f"ended {state}"
                    raise InvalidTransition(
                        f"work item {work_item_id} depends on {dep_id}, which {ended}: retry that first"
                    )
                pending += state != WorkState.SUCCEEDED.value
            rec = self._one(conn, RETRY_DEAD_LETTER, {**params, "pending": pending})
            if rec is None:
                raise refuse(conn)
            item = make_item(rec)
            if bound is not None:
                # Admitted as a submit is, last, under the count row's lock: ``QueueFull`` rolls
                # the update back; a commit adds the item to the count under the same lock.
                self.admit_unfinished(conn, [item], bound)
            return item

        return self._run(run)
