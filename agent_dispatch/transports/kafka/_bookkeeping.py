"""A consumer's per-partition delivery books, kept without a broker (and tested that way).

Which offsets were handed out and are still unacknowledged, where the commit may go (the
contiguous acknowledged prefix), the commit metadata a next owner reads, and receipt tokens.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from agent_dispatch.errors import Fenced

RECEIPT_VERSION: Final = "kafka1"


class SlotState(Enum):
    HELD = "held"  # handed out, waiting for ack/release
    DUE = "due"  # waiting to be redelivered at due_at


@dataclass(slots=True)
class Slot:
    owner: str
    state: SlotState
    deliveries: int
    deadline: float  # HELD: visibility deadline
    due_at: float = 0.0  # DUE: when it may be handed out again


#: Commit metadata version tag. The metadata tells the next owner of a partition what the previous
#: one delivered ("d": highest delivered offset) and which of those were still unacknowledged
#: ("u": offset ranges, "*" when too many to list), so acknowledged turns past the committed
#: prefix are not handed out again and redeliveries are counted.
META_VERSION: Final = "ad1"
#: Brokers accept 4096 bytes of commit metadata by default; beyond this, "u=*" (redeliver all).
META_MAX_CHARS: Final = 2000


@dataclass(frozen=True)
class Prior:
    """What the previous owner of a partition recorded in its last commit."""

    delivered_through: int
    #: Offsets <= delivered_through still unacknowledged then (None: unknown, treat all as such).
    unacked: frozenset[int] | None

    @staticmethod
    def parse(text: str | None) -> Prior | None:
        if not text or not text.startswith(META_VERSION + ";"):
            return None
        fields = dict(item.partition("=")[::2] for item in text.split(";")[1:])
        try:
            through = int(fields["d"])
            listed = fields.get("u", "*")
            if listed == "*":
                return Prior(through, None)
            offsets: set[int] = set()
            for span in filter(None, listed.split(",")):
                first, _, last = span.partition("-")
                offsets.update(range(int(first), int(last or first) + 1))
            return Prior(through, frozenset(offsets))
        except (KeyError, ValueError):
            return None  # not ours or damaged: fall back to redelivering everything


def offset_ranges(offsets: Sequence[int]) -> str:
    """Sorted offsets as compact ranges: 3,5-7,9."""
    spans: list[str] = []
    start = prev = None
    for offset in offsets:
        if start is None:
            start = prev = offset
        elif prev is not None and offset == prev + 1:
            prev = offset
        else:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = offset
    if start is not None:
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(spans)


@dataclass
class PartitionState:
    epoch: int
    #: Highest offset ever returned by the fetch stream in this assignment (None: nothing yet).
    max_seen: int | None = None
    #: Offset the fetch stream returns next (after a seek: the seek target).
    fetch_pos: int | None = None
    #: Delivered and not acknowledged, by offset: what the commit must not pass.
    unacked: dict[int, Slot] = field(default_factory=dict)
    #: Delivered offsets in increasing order (fresh offsets only ever grow); acknowledged ones are
    #: dropped lazily from the left when the commit position is computed.
    order: collections.deque[int] = field(default_factory=collections.deque)
    #: Offsets in ``unacked`` waiting for redelivery.
    due: set[int] = field(default_factory=set)
    #: (offset, metadata) of the last commit sent for this partition, and when it was sent.
    committed: tuple[int, str] | None = None
    sent_at: float = 0.0
    prior_loaded: bool = False
    prior: Prior | None = None
    seek_retry_at: float = 0.0

    def commit_position(self) -> int | None:
        """First offset not acknowledged: the contiguous acknowledged prefix ends just before it."""
        order, unacked = self.order, self.unacked
        while order and order[0] not in unacked:
            order.popleft()
        if order:
            return order[0]
        return None if self.max_seen is None else self.max_seen + 1

    def commit_metadata(self) -> str:
        if self.max_seen is None:
            return ""
        text = f"{META_VERSION};d={self.max_seen};u={offset_ranges(sorted(self.unacked))}"
        return text if len(text) <= META_MAX_CHARS else f"{META_VERSION};d={self.max_seen};u=*"


@dataclass(frozen=True)
class Token:
    consumer: str
    partition: int
    offset: int
    epoch: int
    delivery: int

    def encode(self) -> str:
        return (
            f"{RECEIPT_VERSION}:{self.consumer}:{self.partition}:{self.offset}:{self.epoch}:{self.delivery}"
        )

    @staticmethod
    def decode(token: str) -> Token:
        parts = token.split(":")
        if len(parts) != 6 or parts[0] != RECEIPT_VERSION:
            raise Fenced("not a Kafka transport receipt")
        try:
            return Token(parts[1], int(parts[2]), int(parts[3]), int(parts[4]), int(parts[5]))
        except ValueError:
            raise Fenced("malformed Kafka transport receipt") from None
