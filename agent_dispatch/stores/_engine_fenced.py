"""The lease holder's calls in the Python engine: claim, start, renew, commit, retry, defer.

Each is accepted only while tenant, owner, lease epoch and fencing token all still match and the
lease has not expired (:meth:`EngineBase._fenced`); a repeated commit of the same outcome under
the same token answers as the first did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agent_dispatch.errors import InvalidRequest
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
    check_owner,
    distinct_claims,
    distinct_commits,
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
    """Claim and every fenced WorkItemStore operation over the base's :class:`Tx`."""

    # --- claim -----------------------------------------------------------------------------------

    def claim(
        self,
        owner: str,
        *,
        work_item_id: str | None = None,
        queue: str | None = None,
        tenant: str | None = None,
        ttl_s: float | None = None,
    ) -> Lease | None:
        check_owner(owner)
        ttl = self.limits.ttl(ttl_s)
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

    def start_many(
        self, owner: str, claims: Sequence[tuple[str, str]], *, ttl_s: float | None = None
    ) -> dict[str, StartedTurn]:
        check_owner(owner)
        ttl = self.limits.ttl(ttl_s)
        wanted = distinct_claims(claims)
        started: dict[str, StartedTurn] = {}
        if not wanted:
            return started
        with self._write() as tx:
            for work_item_id, tenant in wanted:
                row = tx.load(work_item_id)
                if row is None:
                    continue
                overdue = row.deadline is not None and row.deadline <= tx.now
                if not startable(view_of(row.record(), now=tx.now), tenant, overdue=overdue):
                    continue
                lease = self._take(tx, row, owner, ttl)  # attempts are left: it leases, never dead-letters
                assert lease is not None
                self._run_row(tx, row)
                payload = tx.payload(work_item_id)
                assert payload is not None
                started[work_item_id] = StartedTurn(make_lease(row.record()), payload)
        return started

    # --- fenced calls ------------------------------------------------------------------------------

    def mark_running(self, lease: Lease) -> Lease:
        with self._write() as tx:
            row = self._fenced(tx, lease)
            if row.state is WorkState.LEASED:
                self._run_row(tx, row)
            return make_lease(row.record())

    def renew(self, lease: Lease, *, ttl_s: float | None = None) -> Lease:
        ttl = self.limits.ttl(ttl_s)
        with self._write() as tx:
            row = self._fenced(tx, lease)
            row.lease_expires_at = tx.now + ttl
            row.updated_at = tx.now
            tx.save(row)
            return make_lease(row.record())

    def require_current(self, lease: Lease) -> None:
        with self._read() as tx:
            self._fenced(tx, lease)

    def commit(
        self,
        lease: Lease,
        outcome: Outcome,
        *,
        retryable: bool = False,
        error: str | None = None,
    ) -> CommitResult:
        outcome = Outcome(outcome)
        if outcome is Outcome.FAILED and retryable:
            item, repeated = self._retry(lease, error)
            return CommitResult(item, repeated=repeated)
        return self._commit(lease, outcome, error)

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

    def commit_many(self, commits: Sequence[tuple[Lease, Outcome, str | None]]) -> dict[str, WorkItem]:
        wanted = distinct_commits(commits)
        committed: dict[str, WorkItem] = {}
        if not wanted:
            return committed
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

    def retry(self, lease: Lease, *, error: str | None = None) -> WorkItem:
        return self._retry(lease, error)[0]

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

    def defer(self, lease: Lease, *, delay_s: float = 0.0) -> WorkItem:
        if delay_s < 0:
            raise InvalidRequest("delay_s must not be negative")
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
