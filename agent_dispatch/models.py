"""The WorkItem lifecycle: states, the records the store returns, and the legal transitions."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Final


class WorkState(StrEnum):
    SUBMITTED = "submitted"
    READY = "ready"
    LEASED = "leased"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEAD_LETTER = "dead_letter"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL: Final = frozenset(
    {WorkState.SUCCEEDED, WorkState.FAILED, WorkState.CANCELLED, WorkState.DEAD_LETTER}
)
LEASED_STATES: Final = frozenset({WorkState.LEASED, WorkState.RUNNING})

#: The only transitions any store accepts (invariant 1). ``ready`` from leased/running is a
#: retry, a deferral, or the recovery of an expired lease.
TRANSITIONS: Final[Mapping[WorkState, frozenset[WorkState]]] = {
    WorkState.SUBMITTED: frozenset({WorkState.READY, WorkState.CANCELLED}),
    WorkState.READY: frozenset({WorkState.LEASED, WorkState.CANCELLED, WorkState.DEAD_LETTER}),
    WorkState.LEASED: frozenset(
        {WorkState.RUNNING, WorkState.READY, WorkState.LEASED, *TERMINAL},
    ),
    WorkState.RUNNING: frozenset({WorkState.READY, WorkState.LEASED, *TERMINAL}),
    **{state: frozenset() for state in TERMINAL},
}


def allowed(source: WorkState, target: WorkState) -> bool:
    return target in TRANSITIONS[source]


class Outcome(StrEnum):
    """What a fenced commit records."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


DEFAULT_QUEUE: Final = "default"
_NAMESPACE = uuid.UUID("6f1c2a52-7d0e-4c59-9a0c-2f6f1d6b8e01")


def deterministic_id(tenant: str, idempotency_key: str) -> str:
    """Redelivery and resubmission are safe because the id is a function of (tenant, key)."""
    return str(uuid.uuid5(_NAMESPACE, f"{tenant}\x00{idempotency_key}"))


def new_id() -> str:
    return str(uuid.uuid4())


@dataclass(frozen=True)
class SubmitRequest:
    tenant: str
    kind: str
    payload: bytes
    session_id: str | None = None
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    deadline: datetime | None = None
    idempotency_key: str | None = None
    work_item_id: str | None = None
    depends_on: tuple[str, ...] = ()
    max_attempts: int | None = None
    fairness_group: str | None = None

    @property
    def known_id(self) -> str | None:
        """The item's id before any store sees the request: the explicit one, else the one the
        idempotency key determines; ``None`` when the store gives the item a new one."""
        if self.work_item_id is not None:
            return self.work_item_id
        if self.idempotency_key is not None:
            return deterministic_id(self.tenant, self.idempotency_key)
        return None


@dataclass(frozen=True)
class WorkItem:
    id: str
    tenant: str
    kind: str
    queue: str
    session_id: str
    state: WorkState
    priority: int
    deadline: datetime | None
    attempt: int
    max_attempts: int
    lease_epoch: int
    fencing_token: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    not_before: datetime | None
    idempotency_key: str | None
    depends_on: tuple[str, ...]
    created_at: datetime
    updated_at: datetime
    fairness_group: str | None = None
    outcome: Outcome | None = None
    error: str | None = None
    payload_size: int = 0

    @property
    def job_id(self) -> str:
        return self.id

    @property
    def terminal(self) -> bool:
        return self.state.terminal


@dataclass(frozen=True)
class Lease:
    """Proof of a claim. Every fenced call presents it whole; the store checks every field."""

    work_item_id: str
    tenant: str
    owner: str
    lease_epoch: int
    fencing_token: int
    expires_at: datetime
    attempt: int = 1


@dataclass(frozen=True)
class SubmitResult:
    item: WorkItem
    created: bool


@dataclass(frozen=True)
class CommitResult:
    item: WorkItem
    #: True when this exact commit had already been applied (a repeated call is a no-op).
    repeated: bool = False
    #: The dependents this commit made ``ready`` (their last dependency succeeded), for the caller
    #: to dispatch now rather than leave to the recovery sweep. Empty on a repeated commit.
    released: tuple[WorkItem, ...] = ()


@dataclass(frozen=True)
class OutcomeRecord:
    """Append-only evidence written around the authoritative commit."""

    work_item_id: str
    tenant: str
    event: str
    owner: str | None
    lease_epoch: int
    fencing_token: int
    at: datetime
    outcome: str | None = None
    detail: str | None = None
    extra: dict[str, str] = field(default_factory=dict)
