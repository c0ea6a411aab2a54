"""The engine's shared base: the transaction a backend supplies, and the row transitions that
more than one operation makes (lease, run, commit, cancel, cascade, release, the outcome record).

The operations themselves live in :mod:`agent_dispatch.stores._engine_fenced` (the lease
holder's calls) and :mod:`agent_dispatch.stores._engine` (submit, reads, unfenced transitions).
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import AbstractContextManager
from datetime import datetime

from agent_dispatch.models import (
    LEASED_STATES,
    Lease,
    Outcome,
    OutcomeRecord,
    WorkState,
)
from agent_dispatch.store import bound_error
from agent_dispatch.stores._calls import StoreCalls
from agent_dispatch.stores._common import (
    COMMIT_STATE,
    Event,
    Limits,
    dependency_reason,
    exhausted_error,
    fence_violation,
    make_lease,
    require_dt,
    view_of,
)
from agent_dispatch.stores._engine_rows import Row, Tx


class EngineBase(StoreCalls):
    """What every engine operation stands on: a serialised :class:`Tx` and the shared transitions."""

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

    # --- shared transitions ------------------------------------------------------------------------

    def _take(self, tx: Tx, row: Row, owner: str, ttl: float, *, running: bool = False) -> Lease | None:
        """Lease ``row``, or dead-letter it when another attempt would exceed its maximum.

        ``running``: lease and start it in one write (``start_many``); both events are recorded.
        """
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
        row.state = WorkState.RUNNING if running else WorkState.LEASED
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
        if running:
            self._event(tx, row, Event.RUNNING)
        return make_lease(row.record())

    def _fenced(self, tx: Tx, lease: Lease, row: Row | None = None) -> Row:
        row = row if row is not None else tx.load(lease.work_item_id)
        violation = fence_violation(None if row is None else view_of(row.record(), now=tx.now), lease)
        if violation is not None:
            raise violation
        assert row is not None
        return row

    def _run_row(self, tx: Tx, row: Row) -> None:
        row.state = WorkState.RUNNING
        row.updated_at = tx.now
        tx.save(row)
        self._event(tx, row, Event.RUNNING)

    def _commit_row(self, tx: Tx, row: Row, lease: Lease, outcome: Outcome, error: str | None) -> None:
        row.state = COMMIT_STATE[outcome]
        row.outcome = outcome
        row.error = error
        row.commit_token = lease.fencing_token
        row.lease_expires_at = None
        row.updated_at = tx.now
        tx.save(row)
        self._event(tx, row, Event.COMMIT, detail=row.error, outcome=outcome)

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

    def _release(self, tx: Tx, root: Row) -> list[Row]:
        """A dependency succeeded: dependents whose dependencies all succeeded become ready now
        (returned, for the committer to dispatch)."""
        released: list[Row] = []
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
                released.append(child)
        return released

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
