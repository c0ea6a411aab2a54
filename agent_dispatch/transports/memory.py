"""An in-process transport for unit tests of the layers above. Never selectable by settings.

It obeys the same contract suite as the real transports (``tests/contract``), scheduling
included, so tests that use it cannot drift: a turn is not handed out before its ``not_before``,
and claims take expired deadlines first, then priority, deadline and admission order.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent_dispatch.errors import DepthUnavailable, Fenced, QueueFull
from agent_dispatch.settings import Backend
from agent_dispatch.transport import Delivery, OutboundTurn, Receipt


@dataclass
class _Row:
    turn: OutboundTurn
    seq: int
    visible_at: float
    claimed_by: str | None = None
    claim_token: str | None = None
    deliveries: int = 0

    def order(self, now: float) -> tuple[int, int, float, int]:
        deadline = math.inf if self.turn.deadline is None else self.turn.deadline
        return (0 if deadline <= now else 1, -self.turn.priority, deadline, self.seq)


class MemoryTransport:
    """Scheduling keys (``not_before``, ``deadline``) are wall-clock seconds, as on the wire."""

    #: Not a ``TASK_QUEUE_BACKEND``: nothing in settings can select it.
    backend: Backend | None = None

    def __init__(
        self,
        *,
        max_depth: int = 100_000,
        visibility_timeout_s: float = 120.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_depth = max_depth
        self.visibility_timeout_s = visibility_timeout_s
        self._clock = clock
        self._rows: dict[str, _Row] = {}
        self._seq = itertools.count()
        self._tokens = itertools.count(1)
        self._cond = threading.Condition()
        self._wakeups = 0  # wake_claims() calls: a claim that sees it change returns
        #: Tests flip this to simulate a failing depth probe.
        self.probe_fails = False

    def ensure_ready(self) -> None:
        return None

    def admit(self, turns: Sequence[OutboundTurn], *, bounded: bool = True) -> None:
        with self._cond:
            if self.probe_fails:
                raise DepthUnavailable("memory transport depth probe disabled")
            fresh = list({t.work_item_id: t for t in turns if t.work_item_id not in self._rows}.values())
            if bounded and len(self._rows) + len(fresh) > self.max_depth:
                raise QueueFull(f"queue depth {len(self._rows)} + {len(fresh)} exceeds {self.max_depth}")
            now = self._clock()
            for turn in fresh:
                visible_at = max(turn.not_before or now, now)
                self._rows[turn.work_item_id] = _Row(turn, next(self._seq), visible_at)
            self._cond.notify_all()

    def claim(self, owner: str, *, max_items: int = 1, wait_s: float = 0.0) -> list[Delivery]:
        give_up = time.monotonic() + wait_s
        with self._cond:
            woken = self._wakeups
            while True:
                now = self._clock()
                visible = sorted(
                    (r for r in self._rows.values() if r.visible_at <= now), key=lambda r: r.order(now)
                )[:max_items]
                if visible or time.monotonic() >= give_up or self._wakeups != woken:
                    break
                self._cond.wait(timeout=min(0.05, max(give_up - time.monotonic(), 0.0)))
            out = []
            for row in visible:
                row.claimed_by = owner
                row.claim_token = f"{row.turn.work_item_id}:{next(self._tokens)}"
                row.visible_at = now + self.visibility_timeout_s
                out.append(
                    Delivery(
                        row.turn.wire, Receipt(owner, row.claim_token), row.turn.work_item_id, row.deliveries
                    )
                )
                row.deliveries += 1
            return out

    def wake_claims(self) -> None:
        with self._cond:
            self._wakeups += 1
            self._cond.notify_all()

    def _owned(self, receipt: Receipt) -> _Row:
        work_item_id = receipt.token.rsplit(":", 1)[0]
        row = self._rows.get(work_item_id)
        if row is None or row.claim_token != receipt.token or row.claimed_by != receipt.owner:
            raise Fenced("stale or foreign receipt")
        return row

    def ack(self, receipt: Receipt) -> None:
        with self._cond:
            row = self._owned(receipt)
            del self._rows[row.turn.work_item_id]

    def ack_many(self, receipts: Sequence[Receipt]) -> list[Receipt]:
        refused: list[Receipt] = []
        with self._cond:
            for receipt in receipts:
                try:
                    row = self._owned(receipt)
                except Fenced:
                    refused.append(receipt)
                else:
                    del self._rows[row.turn.work_item_id]
        return refused

    def release(self, receipt: Receipt, *, delay_s: float = 0.0) -> None:
        with self._cond:
            row = self._owned(receipt)
            row.claimed_by = row.claim_token = None
            row.visible_at = self._clock() + delay_s
            self._cond.notify_all()

    def depth(self) -> int:
        if self.probe_fails:
            raise DepthUnavailable("memory transport depth probe disabled")
        with self._cond:
            return len(self._rows)

    def close(self) -> None:
        return None
