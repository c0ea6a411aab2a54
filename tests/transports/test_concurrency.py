"""Concurrency on the database transports: atomic admission, distinct claims, fenced receipts."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from agent_dispatch.errors import Fenced, QueueFull
from agent_dispatch.transport import Delivery, OutboundTurn, Receipt
from tests.transports.conftest import MakeQueue


def outbound(n: int, tenant: str = "tenant-a") -> OutboundTurn:
    work_item_id = f"wi-{n}-{uuid.uuid4().hex[:8]}"
    return OutboundTurn(work_item_id, f"s-{n}", tenant, work_item_id.encode())


def run_together(count: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run ``fn(i)`` on ``count`` threads released at the same instant."""
    barrier = threading.Barrier(count)

    def body(i: int) -> Any:
        barrier.wait(timeout=30)
        return fn(i)

    with ThreadPoolExecutor(max_workers=count) as pool:
        return [f.result(timeout=120) for f in [pool.submit(body, i) for i in range(count)]]


def test_sixteen_concurrent_submitters_get_exactly_the_bound(make_queue: MakeQueue) -> None:
    bound, submitters, attempts_each = 100, 16, 12
    queue = make_queue(max_depth=bound)

    def submit(i: int) -> int:
        accepted = 0
        for j in range(attempts_each):
            try:
                queue.admit([outbound(i * 1000 + j, tenant=f"tenant-{i % 5}")])
            except QueueFull:
                continue
            accepted += 1
        return accepted

    accepted = run_together(submitters, submit)
    assert sum(accepted) == bound, accepted
    assert queue.depth() == bound
    # The counter agrees with what is really queued.
    deliveries: list[Delivery] = []
    while got := queue.claim("counter", max_items=50):
        deliveries += got
    assert len(deliveries) == bound


def test_concurrent_claimers_take_different_rows(make_queue: MakeQueue) -> None:
    queue = make_queue()
    total = 400
    for start in range(0, total, 100):
        queue.admit([outbound(n, tenant=f"tenant-{n % 7}") for n in range(start, start + 100)])

    def drain(i: int) -> list[str]:
        mine: list[str] = []
        while got := queue.claim(f"w{i}", max_items=1 + i % 3):
            mine += [d.work_item_id for d in got]
            for delivery in got:
                queue.ack(delivery.receipt)
        return mine

    per_worker = run_together(8, drain)
    counts = Counter(w for mine in per_worker for w in mine)
    assert len(counts) == total
    assert max(counts.values()) == 1, "a row was handed to two workers"
    assert sum(1 for mine in per_worker if mine) > 1, "one worker took everything"
    assert queue.depth() == 0


def test_a_stale_receipt_cannot_touch_a_reassigned_row(make_queue: MakeQueue) -> None:
    queue = make_queue(visibility_timeout_s=1.0)
    queue.admit([outbound(1)])
    (stale,) = queue.claim("w1")
    time.sleep(1.3)
    (fresh,) = queue.claim("w2")
    assert fresh.work_item_id == stale.work_item_id
    assert fresh.redelivered == 1

    with pytest.raises(Fenced):
        queue.ack(stale.receipt)
    with pytest.raises(Fenced):
        queue.release(stale.receipt)
    with pytest.raises(Fenced):
        queue.ack(Receipt("w1", fresh.receipt.token))  # the new token under the old owner's name
    assert queue.depth() == 1
    queue.ack(fresh.receipt)
    assert queue.depth() == 0
