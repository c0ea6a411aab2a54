"""The lifecycle written once, in Python, for stores whose write transactions are serialised.

The in-memory store (a lock) and SQLite (``BEGIN IMMEDIATE``) both give a write transaction
exclusive access, so read-check-write inside one is race-free. They supply a :class:`Tx` (rows
in, rows out, at one store-clock instant) and inherit every WorkItemStore operation from
:class:`EngineStore`. PostgreSQL, where many writers run at once, does the same steps as
conditional SQL instead (``postgres.py``); the contract suite holds all of them to one behaviour.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from agent_dispatch.errors import InvalidRequest, InvalidTransition, NotFound
from agent_dispatch.models import (
    LEASED_STATES,
    CommitResult,
    Lease,
    Outcome,
    OutcomeRecord,
    SubmitRequest,
    SubmitResult,
    WorkItem,
    WorkState,
)
from agent_dispatch.store import StartedTurn, backoff_s, bound_error
from agent_dispatch.stores._common import (
    COMMIT_STATE,
    DEPENDENCY_FAILED,
    Event,
    Limits,
    Prepared,
    check_named_claim,
    check_owner,
    dependency_reason,
    distinct_claims,
    distinct_commits,
    exhausted_error,
    fence_violation,
    idempotency_conflict,
    make_item,
    make_lease,
    prepare_submit,
    repeated_commit,
    require_dt,
    startable,
    to_ts,
    view_of,
)


@dataclass
class Row:
    """One WorkItem as the engine stores it: times are unix seconds by the store clock."""

    id: str
    tenant: str
    kind: str
    queue: str
    session_id: str
    state: WorkState
    priority: int
    deadline: float | None
    attempt: int
    max_attempts: int
    lease_epoch: int
    fencing_token: int
    lease_owner: str | None
    lease_expires_at: float | None
    not_before: float | None
    idempotency_key: str | None
    depends_on: tuple[str, ...]
    created_at: float
    updated_at: float
    fairness_group: str | None
    outcome: Outcome | None
    error: str | None
    payload_size: int
    payload_digest: bytes
    #: Token of the fenced commit/retry that set ``outcome`` (how a repeated commit is recognised).
    commit_token: int | None
    #: Dependencies not yet succeeded; the item becomes ready when this reaches zero.
    pending_deps: int
    last_dispatched_at: float | None
    seq: int = 0

    def record(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def copy(self) -> Row:
        return dataclasses.replace(self)


ROW_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Row))


class Tx(Protocol):
    """One transaction: ``now`` is read from the store clock once, when it begins."""

    now: float

    def load(self, work_item_id: str) -> Row | None: ...

    def load_by_key(self, tenant: str, idempotency_key: str) -> Row | None: ...

    def insert(self, row: Row, payload: bytes) -> None:
        """Store a new row; sets ``row.seq``."""

    def save(self, row: Row) -> None: ...

    def link(self, dependent: str, dependencies: Sequence[str]) -> None: ...

    def dependents(self, work_item_id: str) -> list[str]: ...

    def first_claimable(self, queue: str | None, tenant: str | None) -> Row | None:
        """The first row, by (priority desc, seq), that is ready and due or holds an expired lease."""

    def overdue(self, limit: int) -> list[Row]:
        """Non-terminal rows whose deadline has passed, earliest deadline first."""

    def recoverable(self, stale_before: float, limit: int) -> list[Row]: ...

    def touch_dispatched(self, work_item_ids: Sequence[str]) -> None: ...

    def next_token(self) -> int:
        """The next fencing token: strictly greater than every token issued before, store-wide."""

    def append(self, record: OutcomeRecord) -> None: ...

    def outcomes(self, work_item_id: str) -> list[OutcomeRecord]: ...

    def payload(self, work_item_id: str) -> bytes | None: ...

    def list_items(
        self, tenant: str, states: Sequence[WorkState], limit: int, after: str | None
    ) -> list[Row]: ...


class EngineStore(ABC):
    """Every WorkItemStore operation over a serialised :class:`Tx`."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    # --- what a backend supplies ---------------------------------------------------------------

    @abstractmethod
    def _write(self) -> AbstractContextManager[Tx]:
        """An exclusive write transaction, rolled back if the block raises."""

    @abstractmethod
    def _read(self) -> AbstractContextManager[Tx]:
        """A consistent read."""

    # --- clock -----------------------------------------------------------------------------------

    def now(self) -> datetime:
        with self._read() as tx:
            return require_dt(tx.now)

    # --- submit ----------------------------------------------------------------------------------

    def submit(self, request: SubmitRequest) -> SubmitResult:
        prepared = prepare_submit(request, self.limits)
        with self._write() as tx:
            return self._submit_tx(tx, prepared)

    def _submit_tx(self, tx: Tx, prepared: Prepared) -> SubmitResult:
        # The whole submit inside the caller's write transaction (also used by submit_in_transaction).
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
        row = Row(
            id=prepared.id,
            tenant=prepared.tenant,
            kind=prepared.kind,
            queue=prepared.queue,
            session_id=prepared.session_id,
            state=WorkState.SUBMITTED if pending else WorkState.READY,
            priority=prepared.priority,
            deadline=to_ts(prepared.deadline),
            attempt=0,
            max_attempts=prepared.max_attempts,
            lease_epoch=0,
            fencing_token=0,
            lease_owner=None,
            lease_expires_at=None,
            not_before=None,
            idempotency_key=prepared.idempotency_key,
            depends_on=prepared.depends_on,
            created_at=tx.now,
            updated_at=tx.now,
            fairness_group=prepared.fairness_group,
            outcome=None,
            error=None,
            payload_size=len(prepared.payload),
            payload_digest=prepared.digest,
            commit_token=None,
            pending_deps=pending,
            last_dispatched_at=None,
        )
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

    def get_payload(self, work_item_id: str, *, tenant: str) -> bytes:
        with self._read() as tx:
            row = tx.load(work_item_id)
            payload = tx.payload(work_item_id) if row is not None and row.tenant == tenant else None
        if payload is None:
            raise NotFound(f"work item {work_item_id} not found")
        return payload

    def list_items(
        self,
        *,
        tenant: str,
        states: Sequence[WorkState] = (),
        limit: int = 100,
        after: str | None = None,
    ) -> list[WorkItem]:
        if limit < 1:
            raise InvalidRequest("limit must be at least 1")
        with self._read() as tx:
            rows = tx.list_items(tenant, [WorkState(s) for s in states], limit, after)
        return [make_item(row.record()) for row in rows]

    def outcomes(self, work_item_id: str) -> list[OutcomeRecord]:
        with self._read() as tx:
            return tx.outcomes(work_item_id)

    def recoverable(self, *, stale_after_s: float, limit: int = 1000) -> list[WorkItem]:
        with self._read() as tx:
            rows = tx.recoverable(tx.now - stale_after_s, limit)
        return [make_item(row.record()) for row in rows]

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

    def _take(self, tx: Tx, row: Row, owner: str, ttl: float) -> Lease | None:
        """Lease ``row``, or dead-letter it when another attempt would exceed its maximum."""
        if row.attempt >= row.max_attempts:
            row.state = WorkState.DEAD_LETTER
            row.outcome = Outcome.FAILED
            row.error = exhausted_error(row.attempt, row.max_attempts)
            row.lease_expires_at = None
            row.updated_at = tx.now
            tx.save(row)
            self._event(tx, row, Event.DEAD_LETTER, detail=row.error, outcome=row.outcome)
            self._cascade(tx, row)
            return None
        previous = row.lease_owner if row.state in LEASED_STATES else None
        row.state = WorkState.LEASED
        row.attempt += 1
        row.lease_epoch += 1
        row.fencing_token = tx.next_token()
        row.lease_owner = owner
        row.lease_expires_at = tx.now + ttl
        row.not_before = None
        row.commit_token = None
        row.updated_at = tx.now
        tx.save(row)
        detail = None if previous is None else f"reclaimed an expired lease held by {previous}"
        self._event(tx, row, Event.CLAIM, detail=detail)
        return make_lease(row.record())

    # --- fenced calls ------------------------------------------------------------------------------

    def _fenced(self, tx: Tx, lease: Lease, row: Row | None = None) -> Row:
        row = row if row is not None else tx.load(lease.work_item_id)
        violation = fence_violation(None if row is None else view_of(row.record(), now=tx.now), lease)
        if violation is not None:
            raise violation
        assert row is not None
        return row

    def mark_running(self, lease: Lease) -> Lease:
        with self._write() as tx:
            row = self._fenced(tx, lease)
            if row.state is WorkState.LEASED:
                self._run_row(tx, row)
            return make_lease(row.record())

    def _run_row(self, tx: Tx, row: Row) -> None:
        row.state = WorkState.RUNNING
        row.updated_at = tx.now
        tx.save(row)
        self._event(tx, row, Event.RUNNING)

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
        with self._write() as tx:
            row = tx.load(lease.work_item_id)
            if row is not None and repeated_commit(
                view_of(row.record(), now=tx.now), lease, outcome, retryable=False
            ):
                return CommitResult(make_item(row.record()), repeated=True)
            row = self._fenced(tx, lease, row)
            self._commit_row(tx, row, lease, outcome, bound_error(error))
            if outcome is Outcome.SUCCEEDED:
                self._release(tx, row)
            else:
                self._cascade(tx, row)
            return CommitResult(make_item(row.record()))

    def _commit_row(self, tx: Tx, row: Row, lease: Lease, outcome: Outcome, error: str | None) -> None:
        row.state = COMMIT_STATE[outcome]
        row.outcome = outcome
        row.error = error
        row.commit_token = lease.fencing_token
        row.lease_expires_at = None
        row.updated_at = tx.now
        tx.save(row)
        self._event(tx, row, Event.COMMIT, detail=row.error, outcome=outcome)

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

    def mark_dispatched(self, work_item_ids: Sequence[str]) -> None:
        if not work_item_ids:
            return
        with self._write() as tx:
            tx.touch_dispatched(list(work_item_ids))

    # --- helpers -----------------------------------------------------------------------------------

    def _cancel_row(self, tx: Tx, row: Row, reason: str, event: Event) -> None:
        # The lease fields stay: a holder's next fenced call must learn it was *cancelled*.
        row.state = WorkState.CANCELLED
        row.outcome = Outcome.CANCELLED
        row.error = bound_error(reason)
        row.lease_expires_at = None
        row.updated_at = tx.now
        tx.save(row)
        self._event(tx, row, event, detail=row.error, outcome=Outcome.CANCELLED)

    def _cascade(self, tx: Tx, root: Row) -> None:
        """A dependency that can no longer succeed cancels its dependents, transitively, now."""
        frontier = [root]
        while frontier:
            parent = frontier.pop()
            for child_id in tx.dependents(parent.id):
                child = tx.load(child_id)
                if child is None or child.state.terminal:
                    continue
                self._cancel_row(tx, child, dependency_reason(parent.id, parent.state), Event.CANCEL)
                frontier.append(child)

    def _release(self, tx: Tx, root: Row) -> None:
        """A dependency succeeded: dependents whose dependencies all succeeded become ready now."""
        for child_id in tx.dependents(root.id):
            child = tx.load(child_id)
            # Only a waiting dependent counts down; a cancelled one stays as it is.
            if child is None or child.state is not WorkState.SUBMITTED:
                continue
            child.pending_deps = max(child.pending_deps - 1, 0)
            if child.pending_deps == 0:
                child.state = WorkState.READY
                child.updated_at = tx.now
            tx.save(child)
            if child.state is WorkState.READY:
                self._event(tx, child, Event.READY, detail=f"dependency {root.id} succeeded")

    def _event(
        self,
        tx: Tx,
        row: Row,
        event: Event,
        *,
        detail: str | None = None,
        outcome: Outcome | None = None,
        owner: str | None = None,
    ) -> None:
        tx.append(
            OutcomeRecord(
                work_item_id=row.id,
                tenant=row.tenant,
                event=event.value,
                # Who acted: the lease holder (a release clears the row's owner, not the record's).
                owner=owner or row.lease_owner,
                lease_epoch=row.lease_epoch,
                fencing_token=row.fencing_token,
                at=require_dt(tx.now),
                outcome=None if outcome is None else outcome.value,
                detail=bound_error(detail),
            )
        )
