"""Submitting to the PostgreSQL store: one item, or a batch, alone or in the caller's transaction
with the queue in the same database (the enqueue path, :mod:`agent_dispatch.dispatch`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from psycopg import errors
from psycopg.rows import DictRow, dict_row

from agent_dispatch.errors import DispatchError, NotFound
from agent_dispatch.models import Outcome, SubmitRequest, SubmitResult, WorkItem, WorkState
from agent_dispatch.stores._common import (
    DEPENDENCY_FAILED,
    Prepared,
    dependency_reason,
    idempotency_conflict,
    make_item,
    prepare_batch,
    prepare_submit,
)
from agent_dispatch.stores.postgres._base import Conn, PostgresBase
from agent_dispatch.stores.postgres.statements import (
    INSERT_DEPENDENCIES,
    INSERT_ITEM,
    INSERT_MANY,
    LOCK_DEPENDENCIES,
    SELECT_BY_ID_FOR_SUBMIT,
    SELECT_BY_KEY,
)


class Submitting(PostgresBase):
    """The submit half of the store."""

    # --- submit ----------------------------------------------------------------------------------------------

    def submit(self, request: SubmitRequest) -> SubmitResult:
        prepared = prepare_submit(request, self.limits)
        return self._run(lambda conn: self._submit(conn, prepared))

    def _existing(self, conn: Conn, prepared: Prepared) -> DictRow | None:
        rec = self._one(conn, SELECT_BY_ID_FOR_SUBMIT, {"id": prepared.id})
        if rec is None and prepared.idempotency_key is not None:
            rec = self._one(conn, SELECT_BY_KEY, {"tenant": prepared.tenant, "key": prepared.idempotency_key})
        return rec

    def _repeat(self, rec: DictRow, prepared: Prepared) -> SubmitResult:
        conflict = idempotency_conflict(rec, prepared)
        if conflict is not None:
            raise conflict
        return SubmitResult(make_item(rec), created=False)

    def _submit(self, conn: Conn, prepared: Prepared, *, dispatched: bool = False) -> SubmitResult:
        # A repeat (a redelivered submit) is answered from the row that is there, without taking
        # any lock: one with dependencies is looked up before they are locked; one without is
        # found by the insert itself (ON CONFLICT DO NOTHING on the id and on the idempotency key,
        # then the lookup below), which saves a fresh submit the two reads of a lookup first.
        states: dict[str, WorkState] = {}
        if prepared.depends_on:
            existing = self._existing(conn, prepared)
            if existing is not None:
                return self._repeat(existing, prepared)
            locked = conn.execute(
                LOCK_DEPENDENCIES, {"deps": list(prepared.depends_on), "tenant": prepared.tenant}
            ).fetchall()
            states = {rec["id"]: WorkState(rec["state"]) for rec in locked}
            missing = next((d for d in prepared.depends_on if d not in states), None)
            if missing is not None:
                raise NotFound(f"dependency {missing} not found")
        pending = sum(state is not WorkState.SUCCEEDED for state in states.values())
        dead = next((d for d in prepared.depends_on if states[d] in DEPENDENCY_FAILED), None)
        state, outcome, error = WorkState.SUBMITTED if pending else WorkState.READY, None, None
        if dead is not None:
            state, outcome, error = (
                WorkState.CANCELLED,
                Outcome.CANCELLED.value,
                dependency_reason(dead, states[dead]),
            )
        rec = self._one(
            conn,
            INSERT_ITEM,
            self._insert_params(
                prepared, state, pending=pending, outcome=outcome, error=error, dispatched=dispatched
            ),
        )
        if rec is None:
            # ON CONFLICT: a concurrent identical submit committed first (it waited for it).
            existing = self._existing(conn, prepared)
            if existing is None:
                raise errors.SerializationFailure("conflicting submit vanished; retrying")
            return self._repeat(existing, prepared)
        if prepared.depends_on:
            conn.execute(INSERT_DEPENDENCIES, {"deps": list(prepared.depends_on), "id": prepared.id})
        return SubmitResult(make_item(rec), created=True)

    def _insert_params(
        self,
        prepared: Prepared,
        state: WorkState,
        *,
        pending: int = 0,
        outcome: str | None = None,
        error: str | None = None,
        dispatched: bool = False,
    ) -> dict[str, Any]:
        return self._p(
            dispatched=dispatched,
            id=prepared.id,
            tenant=prepared.tenant,
            kind=prepared.kind,
            queue=prepared.queue,
            session_id=prepared.session_id,
            state=state.value,
            priority=prepared.priority,
            deadline=prepared.deadline,
            max_attempts=prepared.max_attempts,
            key=prepared.idempotency_key,
            depends_on=list(prepared.depends_on),
            pending=pending,
            fairness_group=prepared.fairness_group,
            payload=prepared.payload,
            payload_size=len(prepared.payload),
            digest=prepared.digest,
            outcome=outcome,
            error=error,
        )

    # --- one transaction with the queue (the enqueue path, agent_dispatch.dispatch) --------------------------

    def submit_in_transaction(
        self, request: SubmitRequest, then: Callable[[Conn, WorkItem], None], *, dispatched: bool = False
    ) -> SubmitResult:
        """``submit``, then ``then(conn, item)`` for a newly created item in the SAME transaction.

        The queue in the same database admits the item's envelope there: if ``then`` raises, the
        WorkItem is rolled back with it, so a refused admission leaves no orphan. A deadlock
        victim is retried whole, ``then`` included. ``dispatched``: ``then`` admits every created
        ``ready`` item, so its dispatch time is stamped by the insert (no second write of the row).
        ``then`` is the transaction's last step (:meth:`admit_unfinished` relies on it).
        """
        prepared = prepare_submit(request, self.limits)

        def run(conn: Conn) -> SubmitResult:
            result = self._submit(conn, prepared, dispatched=dispatched)
            if result.created:
                then(conn, result.item)
            return result

        return self._run(run)

    def submit_many_in_transaction(
        self,
        requests: Sequence[SubmitRequest],
        then: Callable[[Conn, list[WorkItem]], None],
        *,
        dispatched: bool = False,
    ) -> list[SubmitResult | DispatchError]:
        """``submit`` for a batch in ONE transaction, then ``then(conn, created_items)`` in it too.

        For requests without dependencies (``InvalidRequest`` otherwise, before anything is
        written). Every request gets its own outcome, in order: a ``SubmitResult`` (a repeat of an
        existing item is ``created=False``, as with ``submit``) or the ``DispatchError`` that
        refused it (validation, an idempotency conflict). The inserts go to the server as one
        pipeline, so a batch costs a few round trips instead of a few per request. If ``then``
        raises, nothing of the batch is kept. A deadlock victim is retried whole. ``dispatched``
        as in :meth:`submit_in_transaction`; ``then`` is the transaction's last step here too.
        """
        prepared, refused = prepare_batch(requests, self.limits)

        def run(conn: Conn) -> list[SubmitResult | DispatchError]:
            outcomes: dict[int, SubmitResult | DispatchError] = dict(refused)
            inserted: dict[str, DictRow] = {}
            if prepared:
                ps = [p for _, p in prepared]
                params = self._p(
                    ids=[p.id for p in ps],
                    tenants=[p.tenant for p in ps],
                    kinds=[p.kind for p in ps],
                    queues=[p.queue for p in ps],
                    sessions=[p.session_id for p in ps],
                    priorities=[p.priority for p in ps],
                    deadlines=[p.deadline for p in ps],
                    max_attempts=[p.max_attempts for p in ps],
                    keys=[p.idempotency_key for p in ps],
                    groups=[p.fairness_group for p in ps],
                    payloads=[p.payload for p in ps],
                    digests=[p.digest for p in ps],
                    dispatched=dispatched,
                )
                with conn.cursor(row_factory=dict_row) as cur:
                    inserted = {rec["id"]: rec for rec in cur.execute(INSERT_MANY, params).fetchall()}
            created: list[WorkItem] = []
            for index, p in prepared:
                # A repeat of an id within the batch was inserted once, for its first request.
                rec = inserted.pop(p.id, None)
                if rec is not None:
                    item = make_item(rec)
                    outcomes[index] = SubmitResult(item, created=True)
                    created.append(item)
                    continue
                # ON CONFLICT: the same id or idempotency key exists (maybe earlier in this batch).
                existing = self._existing(conn, p)
                if existing is None:
                    raise errors.SerializationFailure("conflicting submit vanished; retrying")
                try:
                    outcomes[index] = self._repeat(existing, p)
                except DispatchError as exc:
                    outcomes[index] = exc
            then(conn, created)
            return [outcomes[i] for i in range(len(requests))]

        return self._run(run)
