"""The lease holder's calls in the Python engine: claim, start, renew, commit, retry, defer.

Each is accepted only while tenant, owner, lease epoch and fencing token all still match and the
lease has not expired (:meth:`EngineBase._fenced`); a repeated commit of the same outcome under
the same token answers as the first did.
"""

from __future__ import annotations

from collections.abc import Callable

from agent_dispatch.models import (
    CommitResult,
    Lease,
    Outcome,
    WorkItem,
    WorkState,
)
from agent_dispatch.store import StartedTurn, backoff_s, bound_error
from agent_dispatch.stores._common import (
    Event,
    check_named_claim,
    fence_violation,
    make_item,
    make_lease,
    repeated_commit,
    startable,
    view_of,
)
from agent_dispatch.stores._engine_base import EngineBase
from agent_dispatch.stores._engine_rows import Tx


class FencedCalls(EngineBase):
    """Claim and every fenced WorkItemStore operation over the base's :class:`Tx` (the public
    calls, which check their arguments first, are :class:`~agent_dispatch.stores._calls.StoreCalls`')."""

    # --- claim -----------------------------------------------------------------------------------

    def _claim(
        self, owner: str, ttl: float, work_item_id: str | None, queue: str | None, tenant: str | None
    ) -> Lease | None:
        with self._write() as tx:
            if work_item_id is not None:
                named = tx.load(work_item_id)
                view = None if named is None else view_of(named.record(), now=tx.now)
                if not check_named_claim(view, work_item_id, tenant):
                    return None
                assert named is not None
                return self._take(tx, named, owner, ttl)
            while (row := tx.first_claimable(queue, tenant)) is not None:
                lease = self._take(tx, row, owner, ttl)
                if lease is not None:
                    return lease
            return None

    def _start_many(self, owner: str, wanted: list[tuple[str, str]], ttl: float) -> dict[str, StartedTurn]:
        started: dict[str, StartedTurn] = {}
        with self._write() as tx:
            for work_item_id, tenant in wanted:
                row = tx.load(work_item_id)
                if row is None:
                    continue
                overdue = row.deadline is not None and row.deadline <= tx.now
                if not startable(view_of(row.record(), now=tx.now), tenant, overdue=overdue):
                    continue
                # Attempts are left (startable): it leases, never dead-letters.
                lease = self._take(tx, row, owner, ttl, running=True)
                assert lease is not None
                payload = tx.payload(work_item_id)
                assert payload is not None
                started[work_item_id] = StartedTurn(lease, payload)
        return started

    # --- fenced calls ------------------------------------------------------------------------------

    def mark_running(self, lease: Lease) -> Lease:
        with self._write() as tx:
            row = self._fenced(tx, lease)
            if row.state is WorkState.LEASED:
                self._run_row(tx, row)
            return make_lease(row.record())

    def _renew(self, lease: Lease, ttl: float) -> Lease:
        with self._write() as tx:
            row = self._fenced(tx, lease)
            row.lease_expires_at = tx.now + ttl
            row.updated_at = tx.now
            tx.save(row)
            return make_lease(row.record())

    def require_current(self, lease: Lease) -> None:
        with self._read() as tx:
            self._fenced(tx, lease)

    def _commit(
        self,
        lease: Lease,
        outcome: Outcome,
        error: str | None,
        then: Callable[[Tx, list[WorkItem]], None] | None = None,
    ) -> CommitResult:
        """The terminal commit; ``then(tx, released)`` runs in its transaction when it releases
        dependents (the SQLite store's ``commit_in_transaction``)."""
        with self._write() as tx:
            row = tx.load(lease.work_item_id)
            if row is not None and repeated_commit(
                view_of(row.record(), now=tx.now), lease, outcome, retryable=False
            ):
                return CommitResult(make_item(row.record()), repeated=True)
            row = self._fenced(tx, lease, row)
            self._commit_row(tx, row, lease, outcome, bound_error(error))
            released: list[WorkItem] = []
            if outcome is Outcome.SUCCEEDED:
                released = [make_item(child.record()) for child in self._release(tx, row)]
                if released and then is not None:
                    then(tx, released)
            else:
                self._cascade(tx, row)
            return CommitResult(make_item(row.record()), released=tuple(released))

    def _commit_many(self, wanted: list[tuple[Lease, Outcome, str | None]]) -> dict[str, WorkItem]:
        committed: dict[str, WorkItem] = {}
        with self._write() as tx:
            for lease, outcome, error in wanted:
                row = tx.load(lease.work_item_id)
                if row is None or fence_violation(view_of(row.record(), now=tx.now), lease) is not None:
                    continue
                if tx.dependents(row.id):
                    continue  # dependents to settle: commit() does that
                self._commit_row(tx, row, lease, outcome, error)
                committed[row.id] = make_item(row.record())
        return committed

    def _retry(self, lease: Lease, error: str | None) -> tuple[WorkItem, bool]:
        with self._write() as tx:
            row = tx.load(lease.work_item_id)
            if row is not None and repeated_commit(
                view_of(row.record(), now=tx.now), lease, Outcome.FAILED, retryable=True
            ):
                return make_item(row.record()), True
            row = self._fenced(tx, lease, row)
            row.outcome = Outcome.FAILED
            row.error = bound_error(error)
            row.commit_token = lease.fencing_token
            row.lease_expires_at = None
            row.updated_at = tx.now
            if row.attempt >= row.max_attempts:
                row.state = WorkState.DEAD_LETTER
                tx.save(row)
                self._event(tx, row, Event.DEAD_LETTER, detail=row.error, outcome=Outcome.FAILED)
                self._cascade(tx, row)
            else:
                row.state = WorkState.READY
                row.not_before = tx.now + backoff_s(row.attempt)
                row.lease_owner = None
                tx.save(row)
                self._event(tx, row, Event.RETRY, detail=row.error, outcome=Outcome.FAILED, owner=lease.owner)
            return make_item(row.record()), False

    def _defer(self, lease: Lease, delay_s: float) -> WorkItem:
        with self._write() as tx:
            row = self._fenced(tx, lease)
            row.state = WorkState.READY
            row.attempt = max(row.attempt - 1, 0)
            row.not_before = tx.now + delay_s if delay_s > 0 else None
            row.lease_owner = None
            row.lease_expires_at = None
            row.commit_token = None
            row.updated_at = tx.now
            tx.save(row)
            self._event(
                tx, row, Event.DEFER, detail=f"delay {delay_s:g}s" if delay_s else None, owner=lease.owner
            )
            return make_item(row.record())
