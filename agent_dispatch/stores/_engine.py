"""The lifecycle written once, in Python, for stores whose write transactions are serialised.

The in-memory store (a lock) and SQLite (``BEGIN IMMEDIATE``) both give a write transaction
exclusive access, so read-check-write inside one is race-free. They supply a
:class:`~agent_dispatch.stores._engine_rows.Tx` and inherit every WorkItemStore operation from
:class:`EngineStore`: submit, reads and the unfenced transitions here, the lease holder's calls
in :mod:`~agent_dispatch.stores._engine_fenced`, the transitions they share in
:mod:`~agent_dispatch.stores._engine_base`. PostgreSQL, where many writers run at once, does the
same steps as conditional SQL instead (:mod:`agent_dispatch.stores.postgres`); the contract suite
holds all of them to one behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent_dispatch.errors import InvalidTransition, NotFound
from agent_dispatch.models import (
    OutcomeRecord,
    SubmitRequest,
    SubmitResult,
    WorkItem,
    WorkState,
)
from agent_dispatch.store import bound_error
from agent_dispatch.stores._calls import Listing
from agent_dispatch.stores._common import (
    DEPENDENCY_FAILED,
    Event,
    Prepared,
    dependency_reason,
    idempotency_conflict,
    make_item,
    prepare_submit,
)
from agent_dispatch.stores._engine_fenced import FencedCalls
from agent_dispatch.stores._engine_inspect import InspectCalls
from agent_dispatch.stores._engine_rows import Row, Tx


class EngineStore(InspectCalls, FencedCalls):
    """Every WorkItemStore operation over a serialised :class:`Tx`."""

    # --- submit ----------------------------------------------------------------------------------

    def submit(self, request: SubmitRequest) -> SubmitResult:
        prepared = prepare_submit(request, self.limits)
        with self._write() as tx:
            return self._submit_tx(tx, prepared)

    def _submit_tx(self, tx: Tx, prepared: Prepared, *, dispatched: bool = False) -> SubmitResult:
        """The whole submit inside the caller's write transaction (also used by submit_in_transaction).

        ``dispatched``: the caller admits a created ``ready`` item in this same transaction, so it
        is stored with its dispatch time (one write, not an insert and then a stamp).
        """
        existing = tx.load(prepared.id)
        if existing is None and prepared.idempotency_key is not None:
            existing = tx.load_by_key(prepared.tenant, prepared.idempotency_key)
        if existing is not None:
            conflict = idempotency_conflict(existing.record(), prepared)
            if conflict is not None:
                raise conflict
            return SubmitResult(make_item(existing.record()), created=False)
        deps: list[Row] = []
        for dep_id in prepared.depends_on:
            dep = tx.load(dep_id)
            if dep is None or dep.tenant != prepared.tenant:
                raise NotFound(f"dependency {dep_id} not found")
            deps.append(dep)
        pending = sum(dep.state is not WorkState.SUCCEEDED for dep in deps)
        row = Row.new(prepared, tx.now, pending=pending, dispatched=dispatched)
        tx.insert(row, prepared.payload)
        tx.link(row.id, prepared.depends_on)
        self._event(tx, row, Event.SUBMIT)
        dead = next((dep for dep in deps if dep.state in DEPENDENCY_FAILED), None)
        if dead is not None:
            self._cancel_row(tx, row, dependency_reason(dead.id, dead.state), Event.CANCEL)
        return SubmitResult(make_item(row.record()), created=True)

    # --- reads -----------------------------------------------------------------------------------

    def get(self, work_item_id: str, *, tenant: str | None = None) -> WorkItem:
        with self._read() as tx:
            row = tx.load(work_item_id)
        if row is None or (tenant is not None and row.tenant != tenant):
            raise NotFound(f"work item {work_item_id} not found")
        return make_item(row.record())

    def get_many(self, work_item_ids: Sequence[str], *, tenant: str | None = None) -> dict[str, WorkItem]:
        if not work_item_ids:
            return {}
        with self._read() as tx:
            rows = [tx.load(work_item_id) for work_item_id in dict.fromkeys(work_item_ids)]
        return {
            row.id: make_item(row.record())
            for row in rows
            if row is not None and (tenant is None or row.tenant == tenant)
        }

    def get_payload(self, work_item_id: str, *, tenant: str) -> bytes:
        with self._read() as tx:
            row = tx.load(work_item_id)
            payload = tx.payload(work_item_id) if row is not None and row.tenant == tenant else None
        if payload is None:
            raise NotFound(f"work item {work_item_id} not found")
        return payload

    def _list_items(self, page: Listing) -> list[WorkItem]:
        # A listing is a browse with its tenant named: one query for both in every Tx.
        return self._browse(page)

    def outcomes(self, work_item_id: str) -> list[OutcomeRecord]:
        with self._read() as tx:
            return tx.outcomes(work_item_id)

    def recoverable(self, *, stale_after_s: float, limit: int = 1000) -> list[WorkItem]:
        with self._read() as tx:
            rows = tx.recoverable(tx.now - stale_after_s, limit)
        return [make_item(row.record()) for row in rows]

    # --- unfenced transitions ----------------------------------------------------------------------

    def cancel(self, work_item_id: str, *, tenant: str, reason: str) -> WorkItem:
        with self._write() as tx:
            row = tx.load(work_item_id)
            if row is None or row.tenant != tenant:
                raise NotFound(f"work item {work_item_id} not found")
            if row.state.terminal:
                raise InvalidTransition(f"work item {work_item_id} is already {row.state.value}")
            self._cancel_row(tx, row, reason, Event.CANCEL)
            self._cascade(tx, row)
            return make_item(row.record())

    def expire(self, *, limit: int = 1000) -> list[WorkItem]:
        with self._write() as tx:
            # All overdue items first, then their dependents: an overdue dependent is reported
            # as expired, not as cancelled by its dependency (the PostgreSQL store does the same).
            rows = tx.overdue(limit)
            for row in rows:
                self._cancel_row(tx, row, "deadline expired", Event.EXPIRE)
            for row in rows:
                self._cascade(tx, row)
            return [make_item(row.record()) for row in rows]

    def dead_letter(self, work_item_id: str, *, reason: str) -> WorkItem:
        with self._write() as tx:
            row = tx.load(work_item_id)
            if row is None:
                raise NotFound(f"work item {work_item_id} not found")
            if row.state.terminal:
                raise InvalidTransition(f"work item {work_item_id} is already {row.state.value}")
            row.state = WorkState.DEAD_LETTER
            row.error = bound_error(reason)
            row.lease_expires_at = None
            row.updated_at = tx.now
            tx.save(row)
            self._event(tx, row, Event.DEAD_LETTER, detail=row.error)
            self._cascade(tx, row)
            return make_item(row.record())

    def _mark_dispatched(self, work_item_ids: list[str]) -> None:
        with self._write() as tx:
            tx.touch_dispatched(work_item_ids)
