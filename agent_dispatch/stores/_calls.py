"""The WorkItemStore's public calls, written once for every store: each checks its arguments here
and hands the checked values to the backend's hook.

The engine stores (:mod:`agent_dispatch.stores._engine`) and PostgreSQL
(:mod:`agent_dispatch.stores.postgres`) differ in how they carry a call out, never in what they
accept: an owner, a TTL, a limit or a delay is refused here with the same error for all of them,
and a batch is deduplicated here before any backend sees it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from agent_dispatch.errors import InvalidRequest
from agent_dispatch.models import CommitResult, Lease, Outcome, WorkItem, WorkState
from agent_dispatch.store import StartedTurn, TenantStats
from agent_dispatch.stores._common import Limits, check_owner, distinct_claims, distinct_commits


@dataclass(frozen=True)
class Listing:
    """One checked page of ``list_items`` (``tenant`` always set) or ``browse``: newest first,
    ``after`` an item id the page starts below (an id outside ``tenant`` matches nothing)."""

    tenant: str | None
    states: list[WorkState]
    limit: int
    after: str | None
    kind: str | None = None
    session_id: str | None = None


def _check_limit(limit: int) -> None:
    if limit < 1:
        raise InvalidRequest("limit must be at least 1")


class StoreCalls(ABC):
    """The public calls; a store supplies the hooks below them."""

    limits: Limits

    # --- claim and start -------------------------------------------------------------------------

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
        return self._claim(owner, ttl, work_item_id, queue, tenant)

    def start_many(
        self, owner: str, claims: Sequence[tuple[str, str]], *, ttl_s: float | None = None
    ) -> dict[str, StartedTurn]:
        check_owner(owner)
        ttl = self.limits.ttl(ttl_s)
        wanted = distinct_claims(claims)
        if not wanted:
            return {}
        return self._start_many(owner, wanted, ttl)

    # --- fenced calls ------------------------------------------------------------------------------

    def renew(self, lease: Lease, *, ttl_s: float | None = None) -> Lease:
        return self._renew(lease, self.limits.ttl(ttl_s))

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

    def commit_many(self, commits: Sequence[tuple[Lease, Outcome, str | None]]) -> dict[str, WorkItem]:
        wanted = distinct_commits(commits)
        if not wanted:
            return {}
        return self._commit_many(wanted)

    def retry(self, lease: Lease, *, error: str | None = None) -> WorkItem:
        return self._retry(lease, error)[0]

    def defer(self, lease: Lease, *, delay_s: float = 0.0) -> WorkItem:
        if delay_s < 0:
            raise InvalidRequest("delay_s must not be negative")
        return self._defer(lease, delay_s)

    # --- reads and the dispatch stamp ----------------------------------------------------------------

    def list_items(
        self,
        *,
        tenant: str,
        states: Sequence[WorkState] = (),
        limit: int = 100,
        after: str | None = None,
    ) -> list[WorkItem]:
        _check_limit(limit)
        return self._list_items(Listing(tenant, [WorkState(s) for s in states], limit, after))

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
        _check_limit(limit)
        return self._browse(Listing(tenant, [WorkState(s) for s in states], limit, after, kind, session_id))

    def tenant_stats(
        self, *, after: str = "", limit: int = 50, tenants: Sequence[str] | None = None
    ) -> list[TenantStats]:
        _check_limit(limit)
        return self._tenant_stats(after, limit, tenants)

    def mark_dispatched(self, work_item_ids: Sequence[str]) -> None:
        if work_item_ids:
            self._mark_dispatched(list(work_item_ids))

    # --- what a store supplies -----------------------------------------------------------------------

    @abstractmethod
    def _claim(
        self, owner: str, ttl: float, work_item_id: str | None, queue: str | None, tenant: str | None
    ) -> Lease | None:
        """Claim ``work_item_id``, or else the next claimable item (of ``queue``/``tenant`` if named)."""

    @abstractmethod
    def _start_many(self, owner: str, wanted: list[tuple[str, str]], ttl: float) -> dict[str, StartedTurn]:
        """Lease and start each distinct (id, tenant) that is simply claimable; skip the rest."""

    @abstractmethod
    def _renew(self, lease: Lease, ttl: float) -> Lease: ...

    @abstractmethod
    def _commit(self, lease: Lease, outcome: Outcome, error: str | None) -> CommitResult:
        """The terminal commit (a store's ``commit_in_transaction`` passes it one more argument)."""

    @abstractmethod
    def _commit_many(self, wanted: list[tuple[Lease, Outcome, str | None]]) -> dict[str, WorkItem]:
        """Commit each current lease of an item nobody depends on; skip the rest."""

    @abstractmethod
    def _retry(self, lease: Lease, error: str | None) -> tuple[WorkItem, bool]:
        """The retryable failure: (the item, whether this repeats a commit already made)."""

    @abstractmethod
    def _defer(self, lease: Lease, delay_s: float) -> WorkItem: ...

    @abstractmethod
    def _list_items(self, page: Listing) -> list[WorkItem]: ...

    @abstractmethod
    def _browse(self, page: Listing) -> list[WorkItem]: ...

    @abstractmethod
    def _tenant_stats(self, after: str, limit: int, tenants: Sequence[str] | None) -> list[TenantStats]: ...

    @abstractmethod
    def _mark_dispatched(self, work_item_ids: list[str]) -> None: ...
