"""What every store shares: request validation, the fence check, and row <-> WorkItem conversion.

The in-memory and SQLite stores run the lifecycle in Python (``_engine``); PostgreSQL runs it as
conditional SQL. Both classify a refused call with the functions here, so a stale worker gets
the same typed error from every backend.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final

from agent_dispatch.errors import (
    Cancelled,
    DispatchError,
    Fenced,
    IdempotencyConflict,
    InvalidRequest,
    InvalidTransition,
    LeaseExpired,
    LeaseHeld,
    NotFound,
    TenantMismatch,
)
from agent_dispatch.models import (
    LEASED_STATES,
    Lease,
    Outcome,
    SubmitRequest,
    WorkItem,
    WorkState,
    new_id,
)
from agent_dispatch.settings import Settings
from agent_dispatch.store import MAX_TENANT_CHARS, bound_error, check_payload

#: Our rows in the shared ``agent_dispatch_schema_version`` table (the queue has its own component).
COMPONENT: Final = "workitems"
MIGRATE_HINT: Final = "run agent-dispatch migrate"
MAX_ID_CHARS: Final = 200
MAX_OWNER_CHARS: Final = 200
MAX_DEPENDENCIES: Final = 1000

#: States a dependent is cancelled for: the dependency can never succeed any more.
DEPENDENCY_FAILED: Final = frozenset({WorkState.FAILED, WorkState.CANCELLED, WorkState.DEAD_LETTER})

#: The WorkItem fields every backend selects, in one order (the SQL column names are the same).
ITEM_COLUMNS: Final = (
    "id",
    "tenant",
    "kind",
    "queue",
    "session_id",
    "state",
    "priority",
    "deadline",
    "attempt",
    "max_attempts",
    "lease_epoch",
    "fencing_token",
    "lease_owner",
    "lease_expires_at",
    "not_before",
    "idempotency_key",
    "depends_on",
    "created_at",
    "updated_at",
    "fairness_group",
    "outcome",
    "error",
    "payload_size",
)
ITEM_SELECT: Final = ", ".join(ITEM_COLUMNS)
OUTCOME_COLUMNS: Final = (
    "work_item_id",
    "tenant",
    "event",
    "owner",
    "lease_epoch",
    "fencing_token",
    "at",
    "outcome",
    "detail",
)
OUTCOME_SELECT: Final = ", ".join(OUTCOME_COLUMNS)


class Event(StrEnum):
    """Provenance events. Renewals are deliberately absent: they would flood the record."""

    SUBMIT = "submit"
    READY = "ready"
    CLAIM = "claim"
    RUNNING = "running"
    COMMIT = "commit"
    RETRY = "retry"
    DEFER = "defer"
    CANCEL = "cancel"
    EXPIRE = "expire"
    DEAD_LETTER = "dead_letter"
    #: An operator sent a dead-lettered item back to ready (``Inspectable.retry_dead_letter``).
    RETRY_DEAD_LETTER = "retry_dead_letter"


@dataclass(frozen=True)
class Limits:
    """The three settings a store enforces (taken from :class:`Settings` once, at open)."""

    claim_ttl_s: float
    max_attempts: int
    max_payload_bytes: int
    #: A stalled leader loses leadership after this long without a sweep (see try_lead).
    leader_idle_timeout_s: float = 300.0

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        idle = max(settings.claim_ttl_s, 3 * settings.sweep_interval_s)
        return cls(settings.claim_ttl_s, settings.max_attempts, settings.max_payload_bytes, idle)

    def ttl(self, ttl_s: float | None) -> float:
        ttl = self.claim_ttl_s if ttl_s is None else ttl_s
        if not ttl > 0:
            raise InvalidRequest(f"lease TTL must be positive, got {ttl!r}")
        return float(ttl)


# --- time ------------------------------------------------------------------------------------


def to_dt(value: float | datetime | None) -> datetime | None:
    """Stores keep either unix seconds (memory, SQLite) or timestamptz (PostgreSQL)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.astimezone(UTC)
    return datetime.fromtimestamp(value, UTC)


def to_ts(value: datetime | None) -> float | None:
    if value is None:
        return None
    if value.tzinfo is None:
        raise InvalidRequest("timestamps must be timezone-aware")
    return value.timestamp()


def require_dt(value: float | datetime) -> datetime:
    result = to_dt(value)
    assert result is not None
    return result


# --- submit ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    """A validated submit request with its id and payload digest decided."""

    id: str
    tenant: str
    kind: str
    queue: str
    session_id: str
    priority: int
    deadline: datetime | None
    idempotency_key: str | None
    depends_on: tuple[str, ...]
    max_attempts: int
    fairness_group: str | None
    payload: bytes
    digest: bytes
    explicit_id: bool


def _text(name: str, value: object, limit: int, *, required: bool = True) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or (required and not value.strip()):
        raise InvalidRequest(f"{name} is required")
    if len(value) > limit:
        raise InvalidRequest(f"{name} is longer than {limit} characters")


def prepare_submit(request: SubmitRequest, limits: Limits) -> Prepared:
    """Validate before any write, so a refused request stores nothing."""
    _text("tenant", request.tenant, MAX_TENANT_CHARS)
    _text("kind", request.kind, MAX_ID_CHARS)
    _text("queue", request.queue, MAX_ID_CHARS)
    _text("session_id", request.session_id, MAX_ID_CHARS, required=False)
    _text("idempotency_key", request.idempotency_key, MAX_ID_CHARS, required=False)
    _text("work_item_id", request.work_item_id, MAX_ID_CHARS, required=False)
    _text("fairness_group", request.fairness_group, MAX_ID_CHARS, required=False)
    if not isinstance(request.payload, bytes | bytearray | memoryview):
        raise InvalidRequest("payload must be bytes")
    payload = bytes(request.payload)
    check_payload(payload, limits.max_payload_bytes)
    if isinstance(request.priority, bool) or not isinstance(request.priority, int):
        raise InvalidRequest("priority must be an integer")
    if not -(2**31) < request.priority < 2**31:
        raise InvalidRequest("priority is out of range")
    max_attempts = limits.max_attempts if request.max_attempts is None else request.max_attempts
    if not 1 <= max_attempts <= 1000:
        raise InvalidRequest("max_attempts must be between 1 and 1000")
    if request.deadline is not None:
        to_ts(request.deadline)  # rejects naive datetimes
    item_id = request.known_id or new_id()
    # Order kept, duplicates dropped: each dependency releases its dependent exactly once.
    depends_on = tuple(dict.fromkeys(request.depends_on))
    if len(depends_on) > MAX_DEPENDENCIES:
        raise InvalidRequest(f"at most {MAX_DEPENDENCIES} dependencies")
    for dep in depends_on:
        _text("dependency id", dep, MAX_ID_CHARS)
    if item_id in depends_on:
        raise InvalidRequest("a work item cannot depend on itself")
    return Prepared(
        id=item_id,
        tenant=request.tenant,
        kind=request.kind,
        queue=request.queue,
        session_id=request.session_id or item_id,
        priority=request.priority,
        deadline=request.deadline,
        idempotency_key=request.idempotency_key,
        depends_on=depends_on,
        max_attempts=max_attempts,
        fairness_group=request.fairness_group,
        payload=payload,
        digest=hashlib.sha256(payload).digest(),
        explicit_id=request.work_item_id is not None,
    )


def prepare_batch(
    requests: Sequence[SubmitRequest], limits: Limits
) -> tuple[list[tuple[int, Prepared]], dict[int, DispatchError]]:
    """``submit_many_in_transaction``'s requests: the prepared ones by position, and the refused
    ones with their error. Dependencies are refused for the whole batch, before anything is
    written (those requests take the one-by-one path)."""
    prepared: list[tuple[int, Prepared]] = []
    refused: dict[int, DispatchError] = {}
    for index, request in enumerate(requests):
        if request.depends_on:
            raise InvalidRequest("submit_many_in_transaction takes requests without dependencies")
        try:
            prepared.append((index, prepare_submit(request, limits)))
        except DispatchError as exc:
            refused[index] = exc
    return prepared, refused


def idempotency_conflict(existing: Mapping[str, Any], request: Prepared) -> IdempotencyConflict | None:
    """Same request again: ``None`` (return the stored item). Anything else reusing the id/key: a conflict.

    ``existing`` needs id, tenant, kind, idempotency_key and payload_digest.
    """
    if existing["tenant"] != request.tenant:
        # Another tenant's item: say nothing about it beyond "taken".
        return IdempotencyConflict(f"work item id {request.id} is already in use")
    if request.explicit_id and existing["id"] != request.id:
        return IdempotencyConflict(
            f"idempotency key {request.idempotency_key!r} already names work item {existing['id']}"
        )
    if request.idempotency_key is not None and existing["idempotency_key"] != request.idempotency_key:
        return IdempotencyConflict(f"work item {request.id} was submitted with another idempotency key")
    if existing["kind"] != request.kind or bytes(existing["payload_digest"]) != request.digest:
        what = "kind" if existing["kind"] != request.kind else "payload"
        return IdempotencyConflict(f"work item {existing['id']} was submitted with a different {what}")
    return None


# --- the fence ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """What the fence check needs to know about the item right now (``live``/``due`` by the store clock)."""

    id: str
    tenant: str
    state: WorkState
    lease_owner: str | None
    lease_epoch: int
    fencing_token: int
    live: bool
    due: bool
    commit_token: int | None
    outcome: Outcome | None
    attempt: int
    max_attempts: int


def view_of(rec: Mapping[str, Any], *, now: float | None = None) -> View:
    """A View from a record; with ``now`` compute live/due here, else read them from the record."""
    if now is None:
        live, due = bool(rec["live"]), bool(rec["due"])
    else:
        expires, not_before = rec["lease_expires_at"], rec["not_before"]
        live = expires is not None and expires > now
        due = not_before is None or not_before <= now
    outcome = rec["outcome"]
    return View(
        id=rec["id"],
        tenant=rec["tenant"],
        state=WorkState(rec["state"]),
        lease_owner=rec["lease_owner"],
        lease_epoch=int(rec["lease_epoch"]),
        fencing_token=int(rec["fencing_token"]),
        live=live,
        due=due,
        commit_token=rec["commit_token"],
        outcome=None if outcome is None else Outcome(outcome),
        attempt=int(rec["attempt"]),
        max_attempts=int(rec["max_attempts"]),
    )


def fence_violation(view: View | None, lease: Lease) -> DispatchError | None:
    """Why ``lease`` is not the item's current, unexpired lease, or ``None`` when it is.

    Precedence: existence, tenant (before anything about the item is revealed), cancellation
    (the most useful thing a holder can learn), then epoch/token/owner, then state, then expiry.
    """
    item = lease.work_item_id
    if view is None:
        return NotFound(f"work item {item} not found")
    if view.tenant != lease.tenant:
        return TenantMismatch(f"work item {item} does not belong to tenant {lease.tenant!r}")
    if view.state is WorkState.CANCELLED:
        return Cancelled(f"work item {item} was cancelled")
    if (
        view.lease_epoch != lease.lease_epoch
        or view.fencing_token != lease.fencing_token
        or view.lease_owner != lease.owner
    ):
        return Fenced(
            f"work item {item} is held under epoch {view.lease_epoch} (token {view.fencing_token}); "
            f"this lease is epoch {lease.lease_epoch} (token {lease.fencing_token})"
        )
    if view.state.terminal:
        return InvalidTransition(f"work item {item} is already {view.state.value}")
    if view.state not in LEASED_STATES:
        return Fenced(f"work item {item} was released ({view.state.value}); the lease is no longer held")
    if not view.live:
        return LeaseExpired(f"the lease on work item {item} expired (epoch {lease.lease_epoch})")
    return None


def repeated_commit(view: View | None, lease: Lease, outcome: Outcome, *, retryable: bool) -> bool:
    """True when this exact fenced commit (same lease, same outcome) has already been applied."""
    if view is None or view.tenant != lease.tenant or view.outcome is not outcome:
        return False
    if view.commit_token != lease.fencing_token or view.fencing_token != lease.fencing_token:
        return False
    if view.lease_epoch != lease.lease_epoch:
        return False
    # A retry releases the item (owner cleared); otherwise the committing owner is still recorded.
    if view.lease_owner is not None and view.lease_owner != lease.owner:
        return False
    if outcome is Outcome.FAILED and retryable:
        return view.state in (WorkState.READY, WorkState.DEAD_LETTER)
    return view.state is COMMIT_STATE[outcome]


COMMIT_STATE: Final[Mapping[Outcome, WorkState]] = {
    Outcome.SUCCEEDED: WorkState.SUCCEEDED,
    Outcome.FAILED: WorkState.FAILED,
    Outcome.CANCELLED: WorkState.CANCELLED,
}


def check_named_claim(view: View | None, work_item_id: str, tenant: str | None) -> bool:
    """For a claim of one named item: raise why it cannot be claimed, or say whether it can now.

    ``False`` means "not yet" (still backing off until ``not_before``): not an error, not a claim.
    """
    if view is None:
        raise NotFound(f"work item {work_item_id} not found")
    if tenant is not None and view.tenant != tenant:
        raise TenantMismatch(f"work item {work_item_id} does not belong to tenant {tenant!r}")
    if view.state.terminal:
        raise InvalidTransition(f"work item {work_item_id} is already {view.state.value}")
    if view.state is WorkState.SUBMITTED:
        raise InvalidTransition(f"work item {work_item_id} is waiting for its dependencies")
    if view.state in LEASED_STATES and view.live:
        raise LeaseHeld(f"work item {work_item_id} is leased to another worker (epoch {view.lease_epoch})")
    return view.state in LEASED_STATES or view.due


def startable(view: View | None, tenant: str, *, overdue: bool) -> bool:
    """Whether ``start_many`` takes the item: claimable now with no question for ``claim`` to answer.

    The tenant matches; READY and due, or leased with an expired lease; an attempt left; its
    deadline (``overdue``: passed by the store clock) not passed. Anything else is left for
    ``claim``, which raises, dead-letters or waits as the case needs.
    """
    if view is None or view.tenant != tenant or overdue or view.attempt >= view.max_attempts:
        return False
    if view.state is WorkState.READY:
        return view.due
    return view.state in LEASED_STATES and not view.live


def distinct_claims(claims: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """``start_many``'s requests: the first ``(work_item_id, tenant)`` per id, in id order (one lock order)."""
    first: dict[str, str] = {}
    for work_item_id, tenant in claims:
        first.setdefault(work_item_id, tenant)
    return sorted(first.items())


def distinct_commits(
    commits: Sequence[tuple[Lease, Outcome, str | None]],
) -> list[tuple[Lease, Outcome, str | None]]:
    """``commit_many``'s requests: the first per lease identity, outcome checked, error bounded, in id order.

    Two entries can only both pass the fence when they name the same lease, so keeping the first
    of each makes the result the same whether the backend applies them in turn or all at once.
    """
    first: dict[tuple[str, str, str, int, int], tuple[Lease, Outcome, str | None]] = {}
    for lease, outcome, error in commits:
        key = (lease.work_item_id, lease.tenant, lease.owner, lease.lease_epoch, lease.fencing_token)
        if key not in first:
            first[key] = (lease, Outcome(outcome), bound_error(error))
    return [first[key] for key in sorted(first)]


def check_owner(owner: str) -> None:
    _text("owner", owner, MAX_OWNER_CHARS)


def exhausted_error(attempt: int, max_attempts: int) -> str:
    return f"attempts exhausted ({attempt} of {max_attempts})"


def dependency_reason(dependency_id: str, state: WorkState | str) -> str:
    return f"dependency {dependency_id} ended {WorkState(state).value}"


# --- records -> models -------------------------------------------------------------------------


def make_item(rec: Mapping[str, Any]) -> WorkItem:
    """A WorkItem from a record whose keys are :data:`ITEM_COLUMNS` (times as floats or datetimes)."""
    outcome = rec["outcome"]
    return WorkItem(
        id=rec["id"],
        tenant=rec["tenant"],
        kind=rec["kind"],
        queue=rec["queue"],
        session_id=rec["session_id"],
        state=WorkState(rec["state"]),
        priority=int(rec["priority"]),
        deadline=to_dt(rec["deadline"]),
        attempt=int(rec["attempt"]),
        max_attempts=int(rec["max_attempts"]),
        lease_epoch=int(rec["lease_epoch"]),
        fencing_token=int(rec["fencing_token"]),
        lease_owner=rec["lease_owner"],
        lease_expires_at=to_dt(rec["lease_expires_at"]),
        not_before=to_dt(rec["not_before"]),
        idempotency_key=rec["idempotency_key"],
        depends_on=tuple(rec["depends_on"] or ()),
        created_at=require_dt(rec["created_at"]),
        updated_at=require_dt(rec["updated_at"]),
        fairness_group=rec["fairness_group"],
        outcome=None if outcome is None else Outcome(outcome),
        error=rec["error"],
        payload_size=int(rec["payload_size"]),
    )


def make_lease(rec: Mapping[str, Any]) -> Lease:
    expires = to_dt(rec["lease_expires_at"])
    assert expires is not None and rec["lease_owner"] is not None
    return Lease(
        work_item_id=rec["id"],
        tenant=rec["tenant"],
        owner=rec["lease_owner"],
        lease_epoch=int(rec["lease_epoch"]),
        fencing_token=int(rec["fencing_token"]),
        expires_at=expires,
        attempt=int(rec["attempt"]),
    )
