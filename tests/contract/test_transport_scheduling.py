"""The scheduling half of the Transport contract: ``not_before``, deadlines, priorities, batches and
re-drives, on every transport that schedules (memory, SQLite, PostgreSQL; Kafka leaves a turn that
is not due to the worker and orders within a session only)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_dispatch.transport import Transport
from tests.contract._transport_harness import MakeTransport, Owner, eventually, turn

HOUR = 3600.0


def test_a_turn_is_not_handed_out_before_its_not_before(
    make_scheduling_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_scheduling_transport()
    worker = owners(transport, "w1")
    later, due = turn(1, not_before=time.time() + HOUR), turn(2)
    transport.admit([later, due])
    assert transport.depth() == 2, "a delayed turn is accepted and counts toward the bound"

    got = worker.collect(2, wait_s=1.5)
    assert [d.work_item_id for d in got] == [due.work_item_id]
    worker.ack(got[0].receipt)
    assert worker.claim(wait_s=0.5) == []
    assert transport.depth() == 1


def test_a_short_not_before_becomes_due(
    make_scheduling_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_scheduling_transport()
    worker = owners(transport, "w1")
    started = time.monotonic()
    sent = turn(1, not_before=time.time() + 1.5)
    transport.admit([sent])
    got = worker.claim_one(wait_s=20)
    assert time.monotonic() - started >= 1.0, "handed out before its not_before"
    assert got.work_item_id == sent.work_item_id
    worker.ack(got.receipt)


def test_an_expired_deadline_is_served_before_any_priority(
    make_scheduling_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_scheduling_transport()
    worker = owners(transport, "w1")
    urgent = turn(1, priority=100)
    overdue = turn(2, priority=-100, deadline=time.time() - 60)
    transport.admit([urgent, overdue])
    first, second = worker.claim_one(), worker.claim_one()
    # The overdue one goes first: a worker settles it (cancels it as expired) at once.
    assert [first.work_item_id, second.work_item_id] == [overdue.work_item_id, urgent.work_item_id]
    for delivery in (first, second):
        worker.ack(delivery.receipt)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    keys=st.lists(
        st.tuples(st.integers(-2, 2), st.sampled_from([None, 1_000.0, 2_000.0, -30.0])),
        min_size=1,
        max_size=8,
    )
)
def test_claims_follow_deadline_expiry_priority_deadline_and_admission_order(
    make_scheduling_transport: MakeTransport,
    owners: Callable[[Transport, str], Owner],
    keys: list[tuple[int, float | None]],
) -> None:
    """Any mix of priorities and deadlines, admitted one by one: handed out expired deadlines
    first, then higher priority, then earlier deadline, then admission order."""
    transport = make_scheduling_transport()
    worker = owners(transport, "w1")
    now = time.time()
    sent = [turn(i, priority=p, deadline=None if d is None else now + d) for i, (p, d) in enumerate(keys)]
    for one in sent:
        transport.admit([one])

    def order(index: int) -> tuple[int, int, float, int]:
        deadline = sent[index].deadline
        expires = math.inf if deadline is None else deadline
        return (0 if expires <= now else 1, -sent[index].priority, expires, index)

    expected = [sent[i].work_item_id for i in sorted(range(len(sent)), key=order)]
    got = [worker.claim_one() for _ in sent]
    try:
        assert [d.work_item_id for d in got] == expected
    finally:
        for delivery in got:
            worker.ack(delivery.receipt)
    assert transport.depth() == 0


def test_a_batch_claim_takes_at_most_max_items_in_order(
    make_scheduling_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_scheduling_transport()
    worker = owners(transport, "w1")
    sent = [turn(i, priority=i % 3) for i in range(7)]
    transport.admit(sent)
    first = worker.claim(max_items=4, wait_s=5)
    assert 1 <= len(first) <= 4
    rest = worker.collect(7 - len(first))
    got = first + rest
    assert len({d.work_item_id for d in got}) == 7
    ranked = sorted(range(7), key=lambda i: (-sent[i].priority, i))
    assert [d.work_item_id for d in got] == [sent[i].work_item_id for i in ranked]
    for delivery in got:
        worker.ack(delivery.receipt)
    eventually(lambda: transport.depth() == 0)


def test_an_unbounded_redrive_never_doubles_a_queued_turn(
    make_scheduling_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_scheduling_transport(max_depth=1)
    worker = owners(transport, "w1")
    sent = turn(1)
    transport.admit([sent])
    transport.admit([sent], bounded=False)  # the recovery sweep re-drives a turn still queued
    assert transport.depth() == 1
    got = worker.claim_one()
    transport.admit([sent], bounded=False)  # ... and one claimed, not acknowledged yet
    assert transport.depth() == 1
    assert worker.claim(wait_s=0.5) == []
    worker.ack(got.receipt)
    assert transport.depth() == 0


def test_a_release_without_delay_is_at_once_claimable_by_another_owner(
    make_scheduling_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_scheduling_transport()
    first, second = owners(transport, "w1"), owners(transport, "w2")
    sent = turn(1)
    transport.admit([sent])
    got = first.claim_one()
    first.release(got.receipt)
    again = second.claim_one(wait_s=5)
    assert (again.work_item_id, again.receipt.owner) == (sent.work_item_id, "w2")
    assert again.redelivered == 1
    second.ack(again.receipt)
