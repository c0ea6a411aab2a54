"""The PostgreSQL WorkItem store: the production authority (``STATE_DB_URI``).

Many workers write at once here, so nothing is decided by reading and then writing. Every
fenced transition is one conditional ``UPDATE ... WHERE id AND tenant AND owner AND epoch AND
token AND lease_expires_at > now() RETURNING``; only when it matches no row does a follow-up
read classify the refusal (with the same function the other stores use). Fencing tokens come
from one global SEQUENCE. The next ready item is claimed with ``FOR UPDATE SKIP LOCKED`` over a
partial index whose key is exactly the claim's ORDER BY, and an expired lease is reclaimable by
the same statement. Every time is the database's ``now()``: a worker's clock is never consulted.

Round trips: for an item nobody depends on, a claim and a commit are one autocommit statement
each (the lease and its provenance record in one statement through a data-modifying CTE). An
item with dependents takes the transactional form, because releasing or cancelling them must
happen in the same transaction: the fast statements carry ``NOT has_dependents`` so they can
never settle such an item alone. A worker's batch is two statements in all: ``start_many`` leases,
starts and reads every simply claimable item of the batch (``START_MANY``), ``commit_many`` commits
every current lease of an item nobody depends on (``COMMIT_MANY``); what either leaves out goes
the one-by-one way above.

Dependencies are exact under concurrency: a dependency counts its dependents down
(``pending_deps``) with an UPDATE of the dependent row, which PostgreSQL serialises per row, and
the release/cancel runs as a *separate statement in the same transaction* after the dependency's
row is locked, so it sees any dependent whose submit committed while it waited for that lock
(a submit locks its dependencies and sets their ``has_dependents`` flag first).

``set_clock_offset_for_tests`` adds a fixed interval to ``now()`` in every statement (the
``off`` parameter, 0 in production). It exists only so tests can age leases without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from psycopg.rows import DictRow

from agent_dispatch.errors import InvalidTransition, LeaseHeld, NotFound, TenantMismatch
from agent_dispatch.models import CommitResult, Lease, Outcome, WorkItem, WorkState
from agent_dispatch.store import StartedTurn, backoff_s, bound_error
from agent_dispatch.stores._common import (
    COMMIT_STATE,
    DEPENDENCY_FAILED,
    check_named_claim,
    dependency_reason,
    fence_violation,
    make_item,
    make_lease,
    repeated_commit,
)
from agent_dispatch.stores._release import dispatch_released
from agent_dispatch.stores.postgres._base import Conn
from agent_dispatch.stores.postgres._inspect import Inspecting
from agent_dispatch.stores.postgres._submit import Submitting
from agent_dispatch.stores.postgres.statements import (
    CANCEL,
    CASCADE,
    CLAIM_NAMED,
    CLAIM_NAMED_FAST,
    CLAIM_NEXT,
    COMMIT,
    COMMIT_FAST,
    COMMIT_MANY,
    DEAD_LETTER,
    DEFER,
    EXPIRE,
    MARK_DISPATCHED,
    MARK_RUNNING,
    RELEASE,
    RENEW,
    RETRY,
    RETRY_FAST,
    SELECT_ITEM,
    START_MANY,
    START_ONE,
)


class PostgresStore(Inspecting, Submitting):
    """WorkItemStore on PostgreSQL through a psycopg connection pool."""

    # --- claim -----------------------------------------------------------------------------------------------

    def _claim(
        self, owner: str, ttl: float, work_item_id: str | None, queue: str | None, tenant: str | None
    ) -> Lease | None:
        params = self._p(owner=owner, ttl=ttl, id=work_item_id, queue=queue, tenant=tenant)
        if work_item_id is not None:
            # Fast path: one autocommit statement. When it takes nothing, find out why (or take
            # the item in a transaction, if it must be dead-lettered with dependents to cancel).
            fast = self._run(lambda conn: self._take(conn, CLAIM_NAMED_FAST, params), transaction=False)
            if fast[0] is not None:
                return fast[1]
            return self._run(lambda conn: self._claim_named(conn, params))
        sql = CLAIM_NEXT[(queue is not None, tenant is not None)]
        while True:
            rec, lease = self._run(lambda conn: self._take(conn, sql, params), transaction=False)
            if rec is None or lease is not None:
                return lease
            if rec["id"] is None:
                # Spent attempts and dependents: dead-letter and cascade in one transaction.
                try:
                    lease = self._run(partial(self._claim_named, params={**params, "id": rec["candidate"]}))
                except (LeaseHeld, InvalidTransition, NotFound, TenantMismatch):
                    lease = None  # someone else settled it meanwhile
                if lease is not None:
                    return lease
            # The candidate was dead-lettered (its attempts were spent): claim the next one.

    def _take(self, conn: Conn, sql: str, params: Mapping[str, Any]) -> tuple[DictRow | None, Lease | None]:
        rec = self._one(conn, sql, params)
        if rec is None or rec["id"] is None:
            return rec, None
        if rec["state"] == WorkState.LEASED:
            return rec, make_lease(rec)
        if rec["has_dependents"]:
            self._cascade(conn, rec["id"], WorkState(rec["state"]))
        return rec, None

    def _claim_named(self, conn: Conn, params: Mapping[str, Any]) -> Lease | None:
        item_id = params["id"]
        for _ in range(2):
            rec, lease = self._take(conn, CLAIM_NAMED, params)
            if rec is not None:
                return lease
            if not check_named_claim(self._view(conn, item_id), item_id, params["tenant"]):
                return None
            # Claimable on the re-read: its lease expired between the two statements. Once more.
        return None

    # --- fenced calls --------------------------------------------------------------------------------------------

    def mark_running(self, lease: Lease) -> Lease:
        def run(conn: Conn) -> Lease:
            rec = self._one(conn, MARK_RUNNING, self._fence_params(lease))
            if rec is not None:
                return make_lease(rec)
            view = self._view(conn, lease.work_item_id)
            violation = fence_violation(view, lease)
            if violation is not None:
                raise violation
            # Already running under this very lease: nothing to do.
            rec = self._one(conn, SELECT_ITEM, {"id": lease.work_item_id})
            assert rec is not None
            return make_lease(rec)

        return self._run(run, transaction=False)

    def _start_many(self, owner: str, wanted: list[tuple[str, str]], ttl: float) -> dict[str, StartedTurn]:
        if len(wanted) == 1:
            ((work_item_id, tenant),) = wanted
            query, params = START_ONE, self._p(owner=owner, ttl=ttl, id=work_item_id, tenant=tenant)
        else:
            ids, tenants = [i for i, _ in wanted], [tenant for _, tenant in wanted]
            query, params = START_MANY, self._p(owner=owner, ttl=ttl, ids=ids, tenants=tenants)
        rows = self._run(lambda conn: conn.execute(query, params).fetchall(), transaction=False)
        return {rec["id"]: StartedTurn(make_lease(rec), bytes(rec["payload"])) for rec in rows}

    def _renew(self, lease: Lease, ttl: float) -> Lease:
        def run(conn: Conn) -> Lease:
            rec = self._one(conn, RENEW, self._fence_params(lease, ttl=ttl))
            if rec is None:
                raise self._refused(conn, lease)
            return make_lease(rec)

        return self._run(run, transaction=False)

    def require_current(self, lease: Lease) -> None:
        violation = self._run(
            lambda conn: fence_violation(self._view(conn, lease.work_item_id), lease), transaction=False
        )
        if violation is not None:
            raise violation

    def commit_in_transaction(
        self,
        lease: Lease,
        outcome: Outcome,
        then: Callable[[Conn, list[WorkItem]], None],
        *,
        error: str | None = None,
    ) -> CommitResult:
        """``commit``; the dependents it releases are handed to ``then(conn, released)`` in the
        same transaction (the queue in this database admits them there) and stamped dispatched.
        See :meth:`agent_dispatch.store.TransactionalCommit.commit_in_transaction`."""
        return self._commit(lease, Outcome(outcome), error, then)

    def _commit(
        self,
        lease: Lease,
        outcome: Outcome,
        error: str | None,
        then: Callable[[Conn, list[WorkItem]], None] | None = None,
    ) -> CommitResult:
        params = self._fence_params(
            lease, state=COMMIT_STATE[outcome].value, outcome=outcome.value, error=bound_error(error)
        )

        # Fast path: nobody depends on the item, so the one conditional UPDATE is the whole
        # transaction. Otherwise (or when refused) the transactional form decides and explains.
        fast = self._run(lambda conn: self._one(conn, COMMIT_FAST, params), transaction=False)
        if fast is not None:
            return CommitResult(make_item(fast))

        def run(conn: Conn) -> CommitResult:
            rec = self._one(conn, COMMIT, params)
            if rec is None:
                view = self._view(conn, lease.work_item_id)
                if repeated_commit(view, lease, outcome, retryable=False):
                    again = self._one(conn, SELECT_ITEM, {"id": lease.work_item_id})
                    assert again is not None
                    return CommitResult(make_item(again), repeated=True)
                raise self._refused(conn, lease)
            released: list[WorkItem] = []
            if rec["has_dependents"]:
                released = self._settle_dependents(conn, rec["id"], WorkState(rec["state"]))
            if released and then is not None:
                dispatch_released(conn.transaction, then, conn, released, partial(self._stamp, conn))
            return CommitResult(make_item(rec), released=tuple(released))

        return self._run(run)

    def _stamp(self, conn: Conn, work_item_ids: list[str]) -> None:
        conn.execute(MARK_DISPATCHED, self._p(ids=work_item_ids))

    def _commit_many(self, wanted: list[tuple[Lease, Outcome, str | None]]) -> dict[str, WorkItem]:
        if len(wanted) == 1:
            # A batch of one (an idle worker's turn) by the scalar statement: COMMIT_MANY's arrays
            # are planned afresh on every call (0.5 ms of planning against 0.45 of running it).
            ((lease, outcome, error),) = wanted
            params = self._fence_params(
                lease, state=COMMIT_STATE[outcome].value, outcome=outcome.value, error=error
            )
            rec = self._run(lambda conn: self._one(conn, COMMIT_FAST, params), transaction=False)
            return {} if rec is None else {rec["id"]: make_item(rec)}
        params = self._p(
            ids=[lease.work_item_id for lease, _, _ in wanted],
            tenants=[lease.tenant for lease, _, _ in wanted],
            owners=[lease.owner for lease, _, _ in wanted],
            epochs=[lease.lease_epoch for lease, _, _ in wanted],
            tokens=[lease.fencing_token for lease, _, _ in wanted],
            states=[COMMIT_STATE[outcome].value for _, outcome, _ in wanted],
            outcomes=[outcome.value for _, outcome, _ in wanted],
            errors=[error for _, _, error in wanted],
        )
        rows = self._run(lambda conn: conn.execute(COMMIT_MANY, params).fetchall(), transaction=False)
        return {rec["id"]: make_item(rec) for rec in rows}

    def _retry(self, lease: Lease, error: str | None) -> tuple[WorkItem, bool]:
        params = self._fence_params(lease, backoff=backoff_s(lease.attempt), error=bound_error(error))

        fast = self._run(lambda conn: self._one(conn, RETRY_FAST, params), transaction=False)
        if fast is not None:
            return make_item(fast), False

        def run(conn: Conn) -> tuple[WorkItem, bool]:
            rec = self._one(conn, RETRY, params)
            if rec is None:
                if repeated_commit(
                    self._view(conn, lease.work_item_id), lease, Outcome.FAILED, retryable=True
                ):
                    again = self._one(conn, SELECT_ITEM, {"id": lease.work_item_id})
                    assert again is not None
                    return make_item(again), True
                raise self._refused(conn, lease)
            if rec["state"] == WorkState.DEAD_LETTER and rec["has_dependents"]:
                self._cascade(conn, rec["id"], WorkState.DEAD_LETTER)
            return make_item(rec), False

        return self._run(run)

    def _defer(self, lease: Lease, delay_s: float) -> WorkItem:
        params = self._fence_params(lease, delay=delay_s, detail=f"delay {delay_s:g}s" if delay_s else None)

        def run(conn: Conn) -> WorkItem:
            rec = self._one(conn, DEFER, params)
            if rec is None:
                raise self._refused(conn, lease)
            return make_item(rec)

        return self._run(run, transaction=False)

    # --- unfenced transitions ----------------------------------------------------------------------------------

    def cancel(self, work_item_id: str, *, tenant: str, reason: str) -> WorkItem:
        params = self._p(id=work_item_id, tenant=tenant, reason=bound_error(reason))
        return self._settle(CANCEL, params, WorkState.CANCELLED, tenant=tenant)

    def dead_letter(self, work_item_id: str, *, reason: str) -> WorkItem:
        params = self._p(id=work_item_id, reason=bound_error(reason))
        return self._settle(DEAD_LETTER, params, WorkState.DEAD_LETTER)

    def _settle(
        self, sql: str, params: Mapping[str, Any], state: WorkState, *, tenant: str | None = None
    ) -> WorkItem:
        """Move a non-terminal item (of ``tenant``, if named) to ``state``, cancelling its dependents."""
        work_item_id = params["id"]

        def run(conn: Conn) -> WorkItem:
            rec = self._one(conn, sql, params)
            if rec is None:
                view = self._view(conn, work_item_id)
                if view is None or (tenant is not None and view.tenant != tenant):
                    raise NotFound(f"work item {work_item_id} not found")
                raise InvalidTransition(f"work item {work_item_id} is already {view.state.value}")
            if rec["has_dependents"]:
                self._cascade(conn, work_item_id, state)
            return make_item(rec)

        return self._run(run)

    def expire(self, *, limit: int = 1000) -> list[WorkItem]:
        def run(conn: Conn) -> list[WorkItem]:
            rows = conn.execute(EXPIRE, self._p(limit=limit)).fetchall()
            for rec in rows:
                if rec["has_dependents"]:
                    self._cascade(conn, rec["id"], WorkState.CANCELLED)
            return [make_item(rec) for rec in rows]

        return self._run(run)

    def _mark_dispatched(self, work_item_ids: list[str]) -> None:
        params = self._p(ids=work_item_ids)
        self._run(lambda conn: conn.execute(MARK_DISPATCHED, params), transaction=False)

    # --- dependencies ------------------------------------------------------------------------------------------

    def _settle_dependents(self, conn: Conn, parent: str, state: WorkState) -> list[WorkItem]:
        """Release (``parent`` succeeded) or cancel its dependents; returns those made ready."""
        if state is WorkState.SUCCEEDED:
            return [make_item(rec) for rec in conn.execute(RELEASE, self._p(parent=parent)).fetchall()]
        if state in DEPENDENCY_FAILED:
            self._cascade(conn, parent, state)
        return []

    def _cascade(self, conn: Conn, root: str, state: WorkState) -> None:
        """Cancel dependents level by level, each level a statement that sees the one before."""
        frontier = [(root, state)]
        while frontier:
            parent, parent_state = frontier.pop()
            rows = conn.execute(
                CASCADE, self._p(parent=parent, reason=dependency_reason(parent, parent_state))
            ).fetchall()
            frontier.extend((rec["id"], WorkState(rec["state"])) for rec in rows if rec["has_dependents"])
