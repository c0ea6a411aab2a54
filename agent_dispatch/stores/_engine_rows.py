"""What the Python lifecycle engine (:mod:`agent_dispatch.stores._engine`) works on: a
:class:`Row` per WorkItem and the :class:`Tx` a backend supplies (rows in, rows out, at one
store-clock instant). The in-memory and SQLite stores implement ``Tx``; nothing else does."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent_dispatch.models import Outcome, OutcomeRecord, WorkState
from agent_dispatch.stores._calls import Listing
from agent_dispatch.stores._common import Prepared, to_ts


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

    @classmethod
    def new(cls, prepared: Prepared, now: float, *, pending: int, dispatched: bool) -> Row:
        """A newly submitted item: ready (``submitted`` while ``pending`` dependencies are not
        done), no attempt yet, no lease. ``dispatched``: admitted in its submit's transaction."""
        return cls(
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
            created_at=now,
            updated_at=now,
            fairness_group=prepared.fairness_group,
            outcome=None,
            error=None,
            payload_size=len(prepared.payload),
            payload_digest=prepared.digest,
            commit_token=None,
            pending_deps=pending,
            last_dispatched_at=now if dispatched and not pending else None,
        )

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

    def unfinished(self) -> int:
        """How many rows are ``submitted``, ``ready``, ``leased`` or ``running`` in this transaction."""

    # --- reads for the web UI (agent_dispatch.store.Inspectable) ---------------------------------

    def browse(self, page: Listing) -> list[Row]:
        """The page's rows, newest (highest seq) first; also serves ``list_items``."""

    def tenant_stats(
        self, after: str, limit: int, tenants: list[str] | None
    ) -> list[tuple[str, int, int, int, float | None, float | None]]:
        """(tenant, queued, running, done, oldest queued created_at, last claim) in name order."""

    def held(self, limit: int) -> list[Row]: ...

    def events_after(self, seq: int, limit: int) -> list[tuple[int, OutcomeRecord]]: ...
