"""How turns travel to workers: one small Protocol, implementations in ``agent_dispatch.transports``.

Beside it, the optional capabilities a transport may have, each a Protocol of its own:
:class:`AckMany` (acknowledge a batch at once), :class:`WakesClaims` (cut waiting claims short)
and :class:`AdmitOnConnection` (admit inside the WorkItem store's transaction when both share one
database). Every implementation obeys ``tests/contract/test_transport_contract.py``,
capabilities included. A transport carries signed envelope bytes (see
:mod:`agent_dispatch.envelope`); it never interprets them beyond the routing keys it is handed,
and it never decides a WorkItem's fate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from agent_dispatch.settings import Backend


@dataclass(frozen=True)
class OutboundTurn:
    """What admission needs to place one envelope: routing and scheduling keys plus the sealed bytes."""

    work_item_id: str
    session_id: str
    tenant: str
    wire: bytes
    priority: int = 0
    deadline: float | None = None
    fairness_group: str | None = None
    not_before: float | None = None


@dataclass(frozen=True)
class Receipt:
    """Opaque proof of a delivery; it names the owner so nobody else can acknowledge with it."""

    owner: str
    token: str


@dataclass(frozen=True)
class Delivery:
    wire: bytes
    receipt: Receipt
    work_item_id: str
    #: How many times this delivery was handed out before (0 on first delivery).
    redelivered: int = 0


@runtime_checkable
class Transport(Protocol):
    """Carries turns to workers.

    The database queues (and the in-process memory transport) also schedule: a turn is not
    handed out before its ``not_before``; claims take expired deadlines first, then higher
    priority, then earlier deadline, then admission order. Kafka orders within a session only
    (the partition key) and leaves a turn that is not due yet to the worker, which releases it
    with the remaining delay.
    """

    @property
    def backend(self) -> Backend | None:
        """The ``TASK_QUEUE_BACKEND`` this implements; None for a transport settings cannot select."""

    def ensure_ready(self) -> None:
        """Connect, create what is missing (table, topic), or raise ``BackendUnavailable`` naming the backend."""

    def admit(self, turns: Sequence[OutboundTurn], *, bounded: bool = True) -> None:
        """Fail-closed, all-or-nothing admission under the depth bound.

        ``QueueFull`` when the batch would exceed the bound, ``DepthUnavailable`` when the depth
        cannot be established. ``bounded=False`` re-drives already accepted turns (recovery) and
        must not create a second queued delivery for a turn that still has one.
        """

    def claim(self, owner: str, *, max_items: int = 1, wait_s: float = 0.0) -> list[Delivery]:
        """Up to ``max_items`` deliveries for ``owner``, waiting up to ``wait_s`` for the first."""

    def ack(self, receipt: Receipt) -> None:
        """Remove the delivery; ``Fenced`` if the receipt is stale or belongs to another owner."""

    def release(self, receipt: Receipt, *, delay_s: float = 0.0) -> None:
        """Give the delivery back for redelivery after ``delay_s`` (never dropped)."""

    def depth(self) -> int:
        """Queued, not yet acknowledged deliveries; ``DepthUnavailable`` when it cannot be measured.

        The database queues count each turn once. Kafka reports the consumer-group lag, which
        also counts re-driven duplicates and acknowledged offsets not yet committed: a signal for
        autoscaling, not the admission bound (see ``agent_dispatch.dispatch.Counted``)."""

    def close(self) -> None: ...


@runtime_checkable
class AckMany(Protocol):
    """A transport that acknowledges a batch of deliveries in one round trip."""

    def ack_many(self, receipts: Sequence[Receipt]) -> list[Receipt]:
        """Acknowledge every receipt it can; return those refused as stale or foreign (never raises ``Fenced``)."""


@runtime_checkable
class WakesClaims(Protocol):
    """A transport whose waiting claims can be cut short.

    A stopping worker's claim loops wait in ``claim(wait_s=...)``. Woken, every claim waiting in
    this process returns what it has (often nothing) at once, so the loops see the stop and the
    worker's shutdown does not wait out their wait. A claim woken this way is an empty claim, as
    after its wait: callers that are not stopping simply claim again.
    """

    def wake_claims(self) -> None:
        """Make the claims now waiting in this process return without waiting further."""


@runtime_checkable
class KnowsQueued(Protocol):
    """A transport that cannot skip a duplicate on admit, but can say which turns are still queued.

    The database queues skip a turn whose queue row still exists; a log (Kafka) has no row to
    look up, so the recovery sweep asks first and re-drives only turns without a queued delivery.
    """

    def queued_work_items(self) -> frozenset[str] | None:
        """Ids of the work items whose delivery will still be handed out; ``None``: unknown now."""


@runtime_checkable
class AdmitOnConnection(Protocol):
    """A transport that admits on the WorkItem store's connection, inside its open transaction."""

    @property
    def database_identity(self) -> str:
        """Which database the queue lives in; compared with the store's ``database_identity``."""

    def admit_on(self, conn: Any, turns: Sequence[OutboundTurn], *, bounded: bool = True) -> int:
        """``admit`` inside the caller's transaction on ``conn``; returns the rows inserted.

        ``QueueFull`` propagates (the caller rolls back); a turn that already has a queued
        delivery is skipped, never queued twice.
        """
