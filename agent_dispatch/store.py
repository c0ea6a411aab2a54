"""The WorkItem authority: one small Protocol, implementations in ``agent_dispatch.stores``.

Beside it, the optional capabilities a store may have (:class:`TransactionalSubmit`,
:class:`BatchSubmit`, :class:`TransactionalCommit`), each a Protocol of its own: the enqueue path
picks its admission strategy from them once per store/transport pair
(``agent_dispatch.dispatch.choose_admission``), and the worker how it dispatches the dependents
a commit releases.
Every implementation obeys ``tests/contract/test_store_contract.py``. The logic that does not
depend on the database (validation, backoff, bounding error text) lives here, once.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Protocol, runtime_checkable

from agent_dispatch.errors import DispatchError, PayloadTooLarge
from agent_dispatch.models import (
    CommitResult,
    Lease,
    Outcome,
    OutcomeRecord,
    SubmitRequest,
    SubmitResult,
    WorkItem,
    WorkState,
)

#: Schema version this code needs; stores refuse older databases (run ``agent-dispatch migrate``).
SCHEMA_VERSION: Final = 3
MAX_ERROR_CHARS: Final = 2000
MAX_TENANT_CHARS: Final = 200


@dataclass(frozen=True)
class StartedTurn:
    """One delivery leased and started by :meth:`WorkItemStore.start_many`.

    ``lease`` is already RUNNING: the same lease ``claim`` then ``mark_running`` would return.
    """

    lease: Lease
    payload: bytes


@runtime_checkable
class WorkItemStore(Protocol):
    """Lifecycle authority for WorkItems. All lease checks use the store's own clock."""

    def migrate(self) -> int:
        """Create or upgrade the schema; return the version now in force."""

    def now(self) -> datetime:
        """The authority's clock (the database's), which every expiry is measured against."""

    def submit(self, request: SubmitRequest) -> SubmitResult:
        """Atomically create a WorkItem, or return the existing one for the same id/idempotency key."""

    def get(self, work_item_id: str, *, tenant: str | None = None) -> WorkItem:
        """The item; NotFound if absent or (with ``tenant``) owned by another tenant."""

    def get_many(self, work_item_ids: Sequence[str], *, tenant: str | None = None) -> dict[str, WorkItem]:
        """The items of ``work_item_ids`` that :meth:`get` would return, by id, in one read; the
        others (absent, or another tenant's) are left out. For callers that read many at once,
        such as the gateway's coalesced status reads."""

    def get_payload(self, work_item_id: str, *, tenant: str) -> bytes: ...

    def list_items(
        self,
        *,
        tenant: str,
        states: Sequence[WorkState] = (),
        limit: int = 100,
        after: str | None = None,
    ) -> list[WorkItem]:
        """A tenant's items, newest first, paginated by the last id seen (``after``)."""

    def claim(
        self,
        owner: str,
        *,
        work_item_id: str | None = None,
        queue: str | None = None,
        tenant: str | None = None,
        ttl_s: float | None = None,
    ) -> Lease | None:
        """Lease one item (a specific one, or the next ready one of ``queue``).

        Issues ``lease_epoch`` + 1 and a store-wide strictly increasing ``fencing_token``. An
        expired lease is reclaimable in the same statement. ``None`` when nothing is claimable;
        ``LeaseHeld`` when the named item has a live lease; ``NotFound``/``InvalidTransition``
        when the named item is missing or terminal.
        """

    def mark_running(self, lease: Lease) -> Lease: ...

    def start_many(
        self, owner: str, claims: Sequence[tuple[str, str]], *, ttl_s: float | None = None
    ) -> dict[str, StartedTurn]:
        """Lease and start, in one step, each named ``(work_item_id, tenant)`` that is simply claimable.

        Simply claimable: the tenant matches; READY and due, or LEASED/RUNNING with an expired
        lease (a reclaim); an attempt left; no deadline passed (store clock). Each such item gets
        exactly what ``claim`` then ``mark_running`` would give it (attempt, epoch, a fresh fencing
        token, owner, expiry, the 'claim' and 'running' records) and comes back by id with its
        payload. Every other item is left untouched and absent: the caller takes the one-by-one
        path (``claim`` and so on), which explains and handles it. A repeated id is started once
        (its first pair counts). One round trip on PostgreSQL, one transaction elsewhere.
        """

    def commit_many(self, commits: Sequence[tuple[Lease, Outcome, str | None]]) -> dict[str, WorkItem]:
        """Fenced terminal commits, as ``commit(lease, outcome, error=error)`` (not retryable), at once.

        Commits each ``(lease, outcome, error)`` whose lease is current and unexpired and whose
        item nobody depends on; returns the committed items by id. Anything else (fenced, expired,
        already committed, cancelled, or with dependents to settle) is left untouched and absent:
        the caller commits it with ``commit``, which answers or raises as always. Of two entries
        for the same lease only the first counts. One round trip on PostgreSQL.
        """

    def renew(self, lease: Lease, *, ttl_s: float | None = None) -> Lease: ...

    def require_current(self, lease: Lease) -> None:
        """Raise unless ``lease`` is still the item's current, unexpired lease (before a side effect)."""

    def commit(
        self,
        lease: Lease,
        outcome: Outcome,
        *,
        retryable: bool = False,
        error: str | None = None,
    ) -> CommitResult:
        """Fenced terminal commit (a retryable failure goes to ``retry``). Idempotent per lease."""

    def defer(self, lease: Lease, *, delay_s: float = 0.0) -> WorkItem:
        """Fenced release back to ``ready`` without spending an attempt."""

    def retry(self, lease: Lease, *, error: str | None = None) -> WorkItem:
        """Fenced failure: back to ``ready`` after backoff, or ``dead_letter`` when attempts are spent."""

    def cancel(self, work_item_id: str, *, tenant: str, reason: str) -> WorkItem:
        """Cancel from any non-terminal state; a running holder fails its next fenced call."""

    def expire(self, *, limit: int = 1000) -> list[WorkItem]:
        """Cancel non-terminal items whose deadline has passed."""

    def dead_letter(self, work_item_id: str, *, reason: str) -> WorkItem:
        """Move a non-terminal item to ``dead_letter`` (poison handling, unfenced)."""

    def recoverable(self, *, stale_after_s: float, limit: int = 1000) -> list[WorkItem]:
        """Items to re-drive: expired leases, and ready items not dispatched for ``stale_after_s``."""

    def mark_dispatched(self, work_item_ids: Sequence[str]) -> None:
        """Record that a delivery for these items was (re)admitted to the transport now."""

    def outcomes(self, work_item_id: str) -> list[OutcomeRecord]: ...

    def try_lead(self, name: str) -> bool:
        """Take (or keep) single-leader election for ``name``, e.g. the recovery sweep."""

    def close(self) -> None: ...


@runtime_checkable
class TransactionalSubmit(Protocol):
    """A store that runs a caller's step inside its submit transaction (SQLite, PostgreSQL).

    With a queue in the same database (equal :attr:`database_identity`), submit and admission
    are one transaction: a refused admission rolls the WorkItem back with it.
    """

    @property
    def database_identity(self) -> str:
        """Which database this store writes; equal identities mean one transaction can span both."""

    def submit_in_transaction(
        self, request: SubmitRequest, then: Callable[[Any, WorkItem], None], *, dispatched: bool = False
    ) -> SubmitResult:
        """``submit``, then ``then(conn, item)`` for a newly created item in the SAME transaction.

        ``dispatched``: ``then`` admits every created ``ready`` item, so the insert stamps its
        dispatch time. If ``then`` raises, nothing of the submit is kept.
        """


@runtime_checkable
class TransactionalCommit(Protocol):
    """A store that runs a caller's step inside the transaction of a commit that releases
    dependents (SQLite, PostgreSQL): with the queue in the same database, the dependents are
    admitted by the very commit that makes them ``ready``, not by the next recovery sweep.
    """

    @property
    def database_identity(self) -> str:
        """Which database this store writes (see :class:`TransactionalSubmit`)."""

    def commit_in_transaction(
        self,
        lease: Lease,
        outcome: Outcome,
        then: Callable[[Any, list[WorkItem]], None],
        *,
        error: str | None = None,
    ) -> CommitResult:
        """``commit(lease, outcome, error=error)`` (terminal); when it releases dependents,
        ``then(conn, released)`` runs in the SAME transaction, and their dispatch time is stamped.

        ``then`` and the stamp run under a savepoint: if ``then`` raises, only its own work is
        undone, the exception is logged and the commit stands (the released items stay ready and
        undispatched, for the caller or the recovery sweep). ``CommitResult.released`` lists the
        released items either way.
        """


@runtime_checkable
class BatchSubmit(Protocol):
    """A store that submits a whole batch in one transaction (and runs a caller's step in it)."""

    def submit_many_in_transaction(
        self,
        requests: Sequence[SubmitRequest],
        then: Callable[[Any, list[WorkItem]], None],
        *,
        dispatched: bool = False,
    ) -> list[SubmitResult | DispatchError]:
        """``submit`` for each request in ONE transaction, then ``then(conn, created_items)`` in it.

        Each request gets its own outcome, in order. A ``DispatchError`` of the batch as a whole
        (raised by ``then``, or a failed transaction) keeps nothing and propagates.
        """


@runtime_checkable
class CountsUnfinished(Protocol):
    """A store that keeps an O(1) count of its unfinished WorkItems and admits against it.

    Unfinished: ``submitted``, ``ready``, ``leased`` or ``running`` (accepted and not yet in a
    terminal state, whether or not a delivery exists for it). The database keeps the count with
    every transition (triggers), so re-driven duplicates, redeliveries and unacknowledged
    messages never move it. The admission bound when the queue lives outside the store's
    database (Kafka): see ``agent_dispatch.dispatch.Counted``.
    """

    def unfinished(self) -> int:
        """How many WorkItems are unfinished now (one row read, never ``COUNT(*)``)."""

    def admit_unfinished(self, conn: Any, created: Sequence[WorkItem], bound: int) -> None:
        """Compare-and-admit as the ``then`` step of :meth:`TransactionalSubmit.submit_in_transaction`
        or :meth:`BatchSubmit.submit_many_in_transaction`: ``QueueFull`` (the submit keeps
        nothing) when the unfinished items among ``created`` would take the count past ``bound``.
        With none among them (a replay creates nothing) it never refuses."""


@dataclass(frozen=True)
class TenantStats:
    """One tenant's items by where they stand, and when it was last served (the tenants page)."""

    tenant: str
    #: submitted (waiting on dependencies) and ready items.
    queued: int
    #: leased and running items.
    running: int
    #: items in a terminal state (succeeded, failed, cancelled, dead_letter).
    done: int
    #: When the oldest still-queued item was created (``None`` when nothing is queued).
    oldest_waiting: datetime | None
    #: When an item of the tenant was last claimed (``None``: never, as far as the store knows).
    last_served: datetime | None


@dataclass(frozen=True)
class SeqEvent:
    """An outcome record with its place in the store-wide append order (for incremental reads)."""

    seq: int
    record: OutcomeRecord


@runtime_checkable
class Inspectable(Protocol):
    """What the web UI reads and the one operator action it adds; every store has it.

    Each read is bounded by an index (or by ``limit``): the overview must not scan the table,
    and a tenants page costs its tenants, not their items (PostgreSQL keeps per-tenant counters,
    ``stores/postgres/sql/tenants_v1.sql``; the engine stores, local and small, count rows).
    """

    def browse(
        self,
        *,
        tenant: str | None,
        states: Sequence[WorkState] = (),
        kind: str | None = None,
        session_id: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[WorkItem]:
        """Items newest first, of ``tenant`` (``None``: every tenant, for an admin), filtered.

        ``after`` is the last id of the previous page; an id the caller may not see gives ``[]``.
        """

    def dependents(self, work_item_id: str) -> list[str]:
        """Ids of the items that depend on ``work_item_id`` (the caller has checked its tenant)."""

    def tenant_stats(
        self, *, after: str = "", limit: int = 50, tenants: Sequence[str] | None = None
    ) -> list[TenantStats]:
        """Tenants in name order after ``after``, at most ``limit``; with ``tenants``, only those
        of them the store has items of (an administrator's page, or one tenant's own row)."""

    def fold_tenant_counts(self) -> int:
        """Compact the per-tenant counters (PostgreSQL folds their deltas); returns tenants folded."""

    def held_leases(self, *, limit: int = 200) -> list[WorkItem]:
        """Items under a lease (leased or running), soonest expiry first."""

    def events_after(self, seq: int, *, limit: int = 10000) -> list[SeqEvent]:
        """Outcome records appended after ``seq``, in order; ``seq=-1``: only the newest one."""

    def retry_dead_letter(
        self, work_item_id: str, *, tenant: str | None, reason: str, bound: int | None = None
    ) -> WorkItem:
        """An operator's retry: ``dead_letter`` back to ``ready`` with one more attempt.

        Fenced-safe: the item keeps its lease epoch and fencing token, and the next claim issues a
        new one of each, so a stale holder of an old lease stays fenced. The lease, outcome, error
        and commit token are cleared; ``max_attempts`` becomes at least ``attempt + 1``. Dependents
        cancelled when it was dead-lettered stay cancelled. ``NotFound`` if absent or (with
        ``tenant``) another tenant's; ``InvalidTransition`` unless it is dead-lettered.

        The retried item is unfinished again, so with ``bound`` (the admission bound,
        ``AGENT_DISPATCH_MAX_DEPTH``) it is admitted like a submit, in the SAME transaction as the
        transition: ``QueueFull``, and nothing changed, when the unfinished items already number
        ``bound`` or more. Without ``bound`` it is never refused for room.
        """


def check_payload(payload: bytes, limit: int) -> None:
    if len(payload) > limit:
        raise PayloadTooLarge(f"payload is {len(payload)} bytes; the limit is {limit}")


def bound_error(error: str | None) -> str | None:
    """Error detail is stored bounded: evidence, not a log sink."""
    if error is None or len(error) <= MAX_ERROR_CHARS:
        return error
    return error[: MAX_ERROR_CHARS - 15] + "... [truncated]"


def backoff_s(
    attempt: int, *, base_s: float = 1.0, cap_s: float = 300.0, rng: random.Random | None = None
) -> float:
    """Exponential backoff with full jitter, capped at the RTO so retries stay within it."""
    ceiling = min(cap_s, base_s * (2 ** max(attempt - 1, 0)))
    return (rng or random).uniform(ceiling / 2, ceiling)
