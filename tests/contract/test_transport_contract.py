"""The Transport contract, one suite run against every real backend: SQLite, PostgreSQL, Kafka.

Each owner's calls run on a thread of their own, as workers do: a transport may tie consumers
to threads (Kafka does), and the contract must hold either way.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from agent_dispatch.errors import Fenced, QueueFull
from agent_dispatch.settings import Backend, Settings
from agent_dispatch.transport import Delivery, OutboundTurn, Receipt, Transport
from agent_dispatch.transports import open_transport

T = TypeVar("T")
SIGNING_KEY = "contract-suite-signing-key-0123456789abcdef"
#: Long enough for a slow CI machine to finish one step before a claim times out.
SHORT_VISIBILITY_S = 2.0


class MakeTransport(Protocol):
    def __call__(self, *, max_depth: int = ..., visibility_timeout_s: float = ...) -> Transport: ...


ALL_BACKENDS = [
    pytest.param(Backend.SQLITE, id="sqlite"),
    pytest.param(Backend.POSTGRES, id="postgres", marks=pytest.mark.postgres),
    pytest.param(Backend.KAFKA, id="kafka", marks=pytest.mark.kafka),
]


@pytest.fixture(params=ALL_BACKENDS)
def make_transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeTransport]:
    backend: Backend = request.param
    specific: dict[str, Any] = {}
    if backend is Backend.POSTGRES:
        specific["state_db_uri"] = request.getfixturevalue("postgres_dsn")
    elif backend is Backend.KAFKA:
        topic = request.getfixturevalue("kafka_topic_name")
        specific.update(
            kafka_bootstrap_servers=request.getfixturevalue("kafka_bootstrap"),
            kafka_topic=topic,
            kafka_group=f"group-{topic}",
            partitions=2,
        )
    opened: list[Transport] = []

    def make(*, max_depth: int = 1000, visibility_timeout_s: float = 120.0) -> Transport:
        settings = Settings(
            backend_choice=backend,
            max_depth=max_depth,
            visibility_timeout_s=visibility_timeout_s,
            signing_key=SIGNING_KEY,
            data_dir=tmp_path,
            **specific,
        )
        transport = open_transport(settings)
        opened.append(transport)
        return transport

    yield make
    for transport in opened:
        transport.close()


class Owner:
    """A worker identity whose calls all run on one dedicated thread."""

    def __init__(self, transport: Transport, name: str) -> None:
        self.transport = transport
        self.name = name
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self._thread.submit(fn, *args, **kwargs).result(timeout=60)

    def claim(self, *, max_items: int = 1, wait_s: float = 0.0) -> list[Delivery]:
        return self._run(self.transport.claim, self.name, max_items=max_items, wait_s=wait_s)

    def claim_one(self, wait_s: float = 15.0) -> Delivery:
        got = self.claim(wait_s=wait_s)
        assert len(got) == 1, f"{self.name} expected one delivery within {wait_s}s, got {got}"
        return got[0]

    def collect(self, count: int, *, wait_s: float = 15.0) -> list[Delivery]:
        out: list[Delivery] = []
        deadline = time.monotonic() + wait_s
        while len(out) < count and time.monotonic() < deadline:
            out += self.claim(
                max_items=count - len(out), wait_s=min(1.0, max(deadline - time.monotonic(), 0))
            )
        return out

    def ack(self, receipt: Receipt) -> None:
        self._run(self.transport.ack, receipt)

    def release(self, receipt: Receipt, *, delay_s: float = 0.0) -> None:
        self._run(self.transport.release, receipt, delay_s=delay_s)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


@pytest.fixture
def owners() -> Iterator[Callable[[Transport, str], Owner]]:
    made: list[Owner] = []

    def make(transport: Transport, name: str) -> Owner:
        owner = Owner(transport, name)
        made.append(owner)
        return owner

    yield make
    for owner in made:
        owner.close()


def turn(n: int = 0, *, session: str | None = None, priority: int = 0) -> OutboundTurn:
    work_item_id = f"wi-{n}-{uuid.uuid4().hex[:8]}"
    return OutboundTurn(
        work_item_id=work_item_id,
        session_id=session or f"session-{n}",
        tenant="tenant-a",
        wire=f'{{"wire":"{work_item_id}"}}'.encode(),
        priority=priority,
    )


def eventually(check: Callable[[], bool], *, timeout: float = 15.0, polling: Owner | None = None) -> None:
    """Wait for ``check``. ``polling`` keeps claiming meanwhile, as a live worker does: a transport
    may settle acknowledgements from its consumer's own loop (Kafka commits offsets there)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        if polling is not None:
            assert polling.claim(wait_s=0.1) == [], "nothing should be left to claim"
        else:
            time.sleep(0.05)


def first_redelivery(candidates: list[Owner], *, within_s: float) -> tuple[Owner, Delivery]:
    """Poll every candidate until one is handed the delivery (Kafka may redeliver to either)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for owner in candidates:
            got = owner.claim(wait_s=0.25)
            if got:
                assert len(got) == 1
                return owner, got[0]
    raise AssertionError(f"no redelivery within {within_s}s")


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
