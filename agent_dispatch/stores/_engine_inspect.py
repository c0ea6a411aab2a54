"""The web UI's reads and its one operator action (``Inspectable``) for the engine stores.

Memory and SQLite supply the queries through their :class:`~agent_dispatch.stores._engine_rows.Tx`;
the rules (tenant scoping, the dead-letter retry's transition) are written here once. PostgreSQL
does the same in SQL (``agent_dispatch.stores.postgres._inspect``).
"""

from __future__ import annotations

from collections.abc import Sequence

from agent_dispatch.errors import InvalidTransition, NotFound, QueueFull
from agent_dispatch.models import WorkItem, WorkState
from agent_dispatch.store import SeqEvent, TenantStats, bound_error
from agent_dispatch.stores._calls import Listing
from agent_dispatch.stores._common import DEPENDENCY_FAILED, Event, make_item, to_dt
from agent_dispatch.stores._engine_base import EngineBase


class InspectCalls(EngineBase):
    """``agent_dispatch.store.Inspectable`` over a serialised Tx."""

    def _browse(self, page: Listing) -> list[WorkItem]:
        with self._read() as tx:
            rows = tx.browse(page)
        return [make_item(row.record()) for row in rows]

    def dependents(self, work_item_id: str) -> list[str]:
        with self._read() as tx:
            return sorted(tx.dependents(work_item_id))

    def _tenant_stats(self, after: str, limit: int, tenants: Sequence[str] | None) -> list[TenantStats]:
        with self._read() as tx:
            rows = tx.tenant_stats(after, limit, None if tenants is None else list(tenants))
        return [TenantStats(t, q, r, d, to_dt(oldest), to_dt(served)) for t, q, r, d, oldest, served in rows]

    def fold_tenant_counts(self) -> int:
        return 0  # counted from the rows on each read: nothing to compact

    def held_leases(self, *, limit: int = 200) -> list[WorkItem]:
        with self._read() as tx:
            rows = tx.held(limit)
        return [make_item(row.record()) for row in rows]

    def events_after(self, seq: int, *, limit: int = 10000) -> list[SeqEvent]:
        with self._read() as tx:
            return [SeqEvent(n, record) for n, record in tx.events_after(seq, limit)]

    def retry_dead_letter(
        self, work_item_id: str, *, tenant: str | None, reason: str, bound: int | None = None
    ) -> WorkItem:
        with self._write() as tx:
            row = tx.load(work_item_id)
            if row is None or (tenant is not None and row.tenant != tenant):
                raise NotFound(f"work item {work_item_id} not found")
            if row.state is not WorkState.DEAD_LETTER:
                raise InvalidTransition(f"work item {work_item_id} is {row.state.value}, not dead_letter")
            # Its dependencies decide where it goes back to, as at submit: one not yet succeeded
            # means waiting (``submitted``), one that can no longer succeed refuses the retry.
            pending = 0
            for dep_id in row.depends_on:
                dep = tx.load(dep_id)
                if dep is None or dep.state in DEPENDENCY_FAILED:
                    ended = "is gone" if dep is None else f"ended {dep.state.value}"
                    raise InvalidTransition(
                        f"work item {work_item_id} depends on {dep_id}, which {ended}: retry that first"
                    )
                pending += dep.state is not WorkState.SUCCEEDED
            # Unfinished again: admitted under the bound as a submit is, in this write transaction
            # (SQLite's counter; the in-memory store counts its rows), before anything is written.
            if bound is not None:
                unfinished = tx.unfinished()
                if unfinished >= bound:
                    raise QueueFull(f"{unfinished} unfinished turns + 1 would exceed the bound {bound}")
            # Epoch and token stay: the next claim issues new ones, so an old lease stays fenced.
            row.state = WorkState.SUBMITTED if pending else WorkState.READY
            row.pending_deps = pending
            row.max_attempts = max(row.max_attempts, row.attempt + 1)
            row.lease_owner = None
            row.lease_expires_at = None
            row.not_before = None
            row.outcome = None
            row.error = None
            row.commit_token = None
            # Never dispatched since: the recovery sweep re-drives it if the caller's admit is lost.
            row.last_dispatched_at = None
            row.updated_at = tx.now
            tx.save(row)
            self._event(tx, row, Event.RETRY_DEAD_LETTER, detail=bound_error(reason))
            return make_item(row.record())
