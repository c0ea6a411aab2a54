"""How turns travel to workers: one small Protocol, implementations in ``agent_dispatch.transports``.

Every implementation obeys ``tests/contract/test_transport_contract.py``. A transport carries
signed envelope bytes (see :mod:`agent_dispatch.envelope`); it never interprets them beyond the
routing keys it is handed, and it never decides a WorkItem's fate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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
    backend: Backend

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
        """Accepted, not yet acknowledged turns; ``DepthUnavailable`` when it cannot be measured."""

    def close(self) -> None: ...
