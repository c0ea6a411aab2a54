"""Order, delays and re-drives on the database transports (one tenant: no fairness involved)."""

from __future__ import annotations

import time
import uuid

from agent_dispatch.transport import OutboundTurn
from tests.transports.conftest import MakeQueue


def outbound(
    name: str, *, priority: int = 0, deadline: float | None = None, not_before: float | None = None
) -> OutboundTurn:
    return OutboundTurn(
        f"{name}-{uuid.uuid4().hex[:6]}", "s", "tenant-a", name.encode(), priority, deadline, None, not_before
    )


def test_expired_first_then_priority_then_deadline_then_age(make_queue: MakeQueue) -> None:
    queue = make_queue()
    now = time.time()
    sent = [
        outbound("old-low"),
        outbound("high", priority=5),
        outbound("late-deadline", deadline=now + 7200),
        outbound("early-deadline", deadline=now + 3600),
        outbound("expired-low", priority=-3, deadline=now - 5),
        outbound("new-low"),
        outbound("expired-high", priority=2, deadline=now - 1),
    ]
    for turn in sent:
        queue.admit([turn])
    claimed = [bytes(d.wire).decode() for d in queue.claim("w", max_items=3)]
    claimed += [bytes(d.wire).decode() for d in queue.claim("w", max_items=10)]
    assert claimed == [
        "expired-high",
        "expired-low",
        "high",
        "early-deadline",
        "late-deadline",
        "old-low",
        "new-low",
    ]


def test_not_before_holds_the_first_delivery_back(make_queue: MakeQueue) -> None:
    queue = make_queue()
    queue.admit([outbound("later", not_before=time.time() + 1.5)])
    assert queue.depth() == 1, "a delayed turn is accepted (and counted) at once"
    assert queue.claim("w", wait_s=0.5) == []
    (delivery,) = queue.claim("w", wait_s=10)
    assert delivery.wire == b"later"


def test_an_unbounded_redrive_never_doubles_a_queued_delivery(make_queue: MakeQueue) -> None:
    queue = make_queue(max_depth=1)
    turn = outbound("once")
    queue.admit([turn])
    queue.admit([turn], bounded=False)  # the recovery sweep re-driving it
    queue.admit([turn], bounded=True)  # a replay: already queued, so nothing to admit, no QueueFull
    assert queue.depth() == 1
    (delivery,) = queue.claim("w", max_items=5)
    queue.ack(delivery.receipt)
    queue.admit([turn], bounded=False)  # acknowledged: a later re-drive queues it again
    assert queue.depth() == 1
