"""The Transport contract, one suite run against every implementation: memory, SQLite, PostgreSQL,
Kafka (see ``_transport_harness``). Scheduling and the capability Protocols have suites of their own
beside it (``test_transport_scheduling``, ``test_transport_capabilities``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from agent_dispatch.errors import Fenced, QueueFull
from agent_dispatch.settings import Backend
from agent_dispatch.transport import Receipt, Transport
from tests.contract._transport_harness import (
    SHORT_VISIBILITY_S,
    MakeTransport,
    Owner,
    eventually,
    first_redelivery,
    turn,
)


def test_admit_claim_ack(make_transport: MakeTransport, owners: Callable[[Transport, str], Owner]) -> None:
    transport = make_transport()
    worker = owners(transport, "w1")
    sent = turn(1)
    transport.admit([sent])
    eventually(lambda: transport.depth() == 1)

    got = worker.claim_one()
    assert (got.wire, got.work_item_id, got.redelivered) == (sent.wire, sent.work_item_id, 0)
    assert got.receipt.owner == "w1"
    worker.ack(got.receipt)

    eventually(lambda: transport.depth() == 0, polling=worker)
    assert worker.claim(wait_s=0.5) == []


def test_release_with_delay_redelivers(
    make_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_transport()
    worker = owners(transport, "w1")
    sent = turn(1)
    transport.admit([sent])
    first = worker.claim_one()

    worker.release(first.receipt, delay_s=1.5)
    started = time.monotonic()
    again = worker.claim_one(wait_s=20)
    assert time.monotonic() - started >= 1.0, "redelivered before the release delay"
    assert again.work_item_id == sent.work_item_id
    assert again.redelivered >= 1
    worker.ack(again.receipt)
    eventually(lambda: transport.depth() == 0, polling=worker)


def test_withheld_ack_is_redelivered_after_the_visibility_timeout(
    make_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_transport(visibility_timeout_s=SHORT_VISIBILITY_S)
    first, second = owners(transport, "w1"), owners(transport, "w2")
    sent = turn(1)
    transport.admit([sent])
    withheld = first.claim_one()

    holder, again = first_redelivery([second, first], within_s=SHORT_VISIBILITY_S + 20)
    assert again.work_item_id == sent.work_item_id
    # Kafka keeps no per-message delivery count: a consumer that takes over a partition cannot
    # know the message was handed out before. Every other case must count the redelivery.
    if not (transport.backend is Backend.KAFKA and holder is second):
        assert again.redelivered >= 1
    assert again.receipt != withheld.receipt
    # The first claim was reassigned: its receipt must not remove the newer claim's delivery.
    with pytest.raises(Fenced):
        first.ack(withheld.receipt)
    holder.ack(again.receipt)
    eventually(lambda: transport.depth() == 0, polling=holder)


def test_foreign_and_malformed_receipts_are_refused(
    make_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_transport()
    worker, other = owners(transport, "w1"), owners(transport, "w2")
    transport.admit([turn(1)])
    got = worker.claim_one()

    with pytest.raises(Fenced):
        other.ack(Receipt("w2", got.receipt.token))
    with pytest.raises(Fenced):
        worker.ack(Receipt("w1", "not-a-receipt"))
    with pytest.raises(Fenced):
        other.release(Receipt("w2", got.receipt.token))
    # None of that disturbed the real claim.
    worker.ack(got.receipt)
    eventually(lambda: transport.depth() == 0, polling=worker)
    with pytest.raises(Fenced):
        worker.ack(got.receipt)  # acknowledged already: the receipt is stale now


def test_depth_counts_accepted_unacknowledged_turns(
    make_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_transport()
    worker = owners(transport, "w1")
    assert transport.depth() == 0
    transport.admit([turn(i) for i in range(3)])
    eventually(lambda: transport.depth() == 3)
    got = worker.collect(3)
    assert len(got) == 3
    assert transport.depth() == 3, "claimed but unacknowledged turns still count"
    worker.ack(got[0].receipt)
    eventually(lambda: transport.depth() == 2, polling=worker)


def test_bound_is_enforced_and_batches_are_all_or_nothing(
    make_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_transport(max_depth=3)
    worker = owners(transport, "w1")
    accepted = [turn(0), turn(1)]
    transport.admit(accepted)
    eventually(lambda: transport.depth() == 2)

    with pytest.raises(QueueFull):
        transport.admit([turn(2), turn(3)])  # 2 + 2 > 3: neither may be accepted
    assert transport.depth() == 2

    last = turn(4)
    transport.admit([last])
    eventually(lambda: transport.depth() == 3)
    with pytest.raises(QueueFull):
        transport.admit([turn(5)])

    got = worker.collect(3)
    assert sorted(d.work_item_id for d in got) == sorted(t.work_item_id for t in [*accepted, last])
    assert worker.claim(wait_s=0.5) == []
    for delivery in got:
        worker.ack(delivery.receipt)
    eventually(lambda: transport.depth() == 0, polling=worker)
    transport.admit([turn(6)])  # acknowledgements made room again


def test_batch_claim_and_same_session_order(
    make_transport: MakeTransport, owners: Callable[[Transport, str], Owner]
) -> None:
    transport = make_transport()
    worker = owners(transport, "w1")
    sent = [turn(i, session="one-session") for i in range(5)]
    transport.admit(sent)
    got = worker.collect(5)
    # Same priority, no deadlines, one session: every transport hands them out in admission order.
    assert [d.work_item_id for d in got] == [t.work_item_id for t in sent]
    assert len({d.receipt.token for d in got}) == 5
    for delivery in got:
        worker.ack(delivery.receipt)
    eventually(lambda: transport.depth() == 0, polling=worker)
