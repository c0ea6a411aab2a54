"""The Kafka transport against a real KRaft broker: redelivery, prefix commits, order, fencing, admission.

Every wait is bounded; a broker stopped by a test is started again in ``finally``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from agent_dispatch.errors import BackendUnavailable, DepthUnavailable, Fenced, QueueFull
from agent_dispatch.settings import load
from agent_dispatch.transport import Delivery, OutboundTurn, Transport
from agent_dispatch.transports.kafka import (
    KafkaTransport,
    KafkaTuning,
    PartitionDecreaseRefused,
    consumer_group_lag,
    ensure_topic,
    offsets_reader,
    topic_partition_count,
)
from testenv.kafka import KafkaBroker

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

T = TypeVar("T")
WAIT_S = 20.0


def _turn(work_item_id: str, session_id: str = "s", payload: bytes | None = None) -> OutboundTurn:
    return OutboundTurn(
        work_item_id=work_item_id, session_id=session_id, tenant="t", wire=payload or work_item_id.encode()
    )


@pytest.fixture
def make_transport(kafka_bootstrap: str, kafka_topic_name: str) -> Iterator[Callable[..., KafkaTransport]]:
    made: list[KafkaTransport] = []

    def make(*, partitions: int = 1, max_depth: int = 100_000, **tuning: Any) -> KafkaTransport:
        settings = load(
            backend_choice="kafka",
            kafka_bootstrap_servers=kafka_bootstrap,
            kafka_topic=kafka_topic_name,
            kafka_group=f"g.{kafka_topic_name}",
            partitions=partitions,
            max_depth=max_depth,
        )
        transport = KafkaTransport(settings, tuning=KafkaTuning(**tuning))
        made.append(transport)
        transport.ensure_ready()
        return transport

    yield make
    for transport in made:
        transport.close()


def _in_thread(fn: Callable[[], T], timeout: float = WAIT_S * 2) -> T:
    """Run ``fn`` on a fresh thread (its own consumer) and return its result or raise its error."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result(timeout=timeout)


def _claim_until(
    transport: KafkaTransport, count: int, *, owner: str = "w", max_items: int = 10, timeout: float = WAIT_S
) -> list[Delivery]:
    """Claim on the calling thread until ``count`` deliveries arrived (or fail at ``timeout``)."""
    out: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(out) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(out)} of {count} deliveries arrived within {timeout} s"
        out.extend(transport.claim(owner, max_items=min(max_items, count - len(out)), wait_s=min(left, 1.0)))
    return out


def _committed(bootstrap: str, group: str, topic: str, partitions: int = 1) -> dict[int, int]:
    # A Consumer handle, not the AdminClient's ListConsumerGroupOffsets (see consumer_group_lag).
    reader = offsets_reader(bootstrap, group)
    try:
        found = reader.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=15)
    finally:
        reader.close()
    return {tp.partition: tp.offset for tp in found}


def _eventually(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_satisfies_the_transport_protocol(make_transport: Callable[..., KafkaTransport]) -> None:
    transport = make_transport()
    assert isinstance(transport, Transport)
    assert transport.depth() == 0


def test_withheld_ack_is_redelivered_to_the_same_consumer(
    make_transport: Callable[..., KafkaTransport],
) -> None:
    transport = make_transport(visibility_timeout_s=1.5)
    transport.admit([_turn("a"), _turn("b")])
    first = _claim_until(transport, 2)
    assert [d.work_item_id for d in first] == ["a", "b"]
    transport.ack(first[1].receipt)
    # "a" is withheld: neither acknowledged nor released. After the visibility timeout it returns.
    started = time.monotonic()
    again = _claim_until(transport, 1)
    assert time.monotonic() - started >= 1.0
    assert again[0].work_item_id == "a"
    assert again[0].redelivered == 1
    assert again[0].wire == b"a"
    with pytest.raises(Fenced):
        transport.ack(first[0].receipt)  # the old receipt is stale now
    transport.ack(again[0].receipt)
    assert transport.claim("w", wait_s=0.5) == []


def test_released_delivery_comes_back_after_its_delay(make_transport: Callable[..., KafkaTransport]) -> None:
    transport = make_transport()
    transport.admit([_turn(f"t{i}") for i in range(4)])
    got = _claim_until(transport, 4)
    transport.release(got[1].receipt, delay_s=1.0)
    for delivery in (got[0], got[2], got[3]):
        transport.ack(delivery.receipt)
    released_at = time.monotonic()
    assert transport.claim("w", max_items=4, wait_s=0.3) == []  # not before its delay
    again = _claim_until(transport, 1)
    assert time.monotonic() - released_at >= 0.9
    # Seeking back to t1 must not hand out t2 and t3 again: they are acknowledged.
    assert [(d.work_item_id, d.redelivered) for d in again] == [("t1", 1)]
    assert transport.claim("w", max_items=4, wait_s=0.5) == []
    with pytest.raises(Fenced):
        transport.ack(got[1].receipt)  # given back: that receipt is spent
    transport.ack(again[0].receipt)


def test_withheld_ack_is_redelivered_to_another_consumer(
    make_transport: Callable[..., KafkaTransport], kafka_bootstrap: str, kafka_topic_name: str
) -> None:
    transport = make_transport()
    transport.admit([_turn(f"t{i}") for i in range(3)])

    def first_worker() -> list[str]:
        got = _claim_until(transport, 3, owner="w1")
        transport.ack(got[0].receipt)
        transport.ack(got[2].receipt)  # t1 withheld; the worker thread then goes away
        transport.close_consumer()
        return [d.work_item_id for d in got]

    assert _in_thread(first_worker) == ["t0", "t1", "t2"]
    # Only the contiguous prefix (t0) was committed: the next owner starts at t1.
    assert _committed(kafka_bootstrap, f"g.{kafka_topic_name}", kafka_topic_name) == {0: 1}

    def second_worker() -> list[tuple[str, str, int]]:
        got = _claim_until(transport, 1, owner="w2")
        got += transport.claim("w2", max_items=5, wait_s=1.0)  # nothing else may come
        for delivery in got:
            transport.ack(delivery.receipt)
        transport.close_consumer()
        return [(d.work_item_id, d.receipt.owner, d.redelivered) for d in got]

    # t2 does not come again: the first worker's commit metadata recorded it as acknowledged.
    assert _in_thread(second_worker) == [("t1", "w2", 1)]
    assert _committed(kafka_bootstrap, f"g.{kafka_topic_name}", kafka_topic_name) == {0: 3}


def test_committed_offsets_never_pass_an_unacknowledged_turn(
    make_transport: Callable[..., KafkaTransport], kafka_bootstrap: str, kafka_topic_name: str
) -> None:
    group = f"g.{kafka_topic_name}"
    transport = make_transport(commit_interval_s=0.0)
    transport.admit([_turn(f"t{i}") for i in range(10)])
    got = _claim_until(transport, 10)
    assert [d.work_item_id for d in got] == [f"t{i}" for i in range(10)]
    withheld = {3, 7}
    observed: list[int] = []
    for index, delivery in enumerate(got):
        if index not in withheld:
            transport.ack(delivery.receipt)
            transport.claim("w", wait_s=0)  # flushes commits
            observed.append(_committed(kafka_bootstrap, group, kafka_topic_name)[0])
    # Never past offset 3 while t3 is unacknowledged (offsets equal indexes on a fresh topic).
    assert max(observed) <= 3
    _eventually(
        lambda: _committed(kafka_bootstrap, group, kafka_topic_name)[0] == 3, "commit of the prefix t0..t2"
    )
    transport.ack(got[3].receipt)
    transport.claim("w", wait_s=0)
    _eventually(lambda: _committed(kafka_bootstrap, group, kafka_topic_name)[0] == 7, "commit up to t7")
    time.sleep(0.3)
    assert _committed(kafka_bootstrap, group, kafka_topic_name)[0] == 7
    transport.ack(got[7].receipt)
    transport.claim("w", wait_s=0)
    _eventually(lambda: _committed(kafka_bootstrap, group, kafka_topic_name)[0] == 10, "commit of everything")
    _eventually(lambda: transport.depth() == 0, "depth 0 once everything is acknowledged")


def test_turns_of_one_session_arrive_in_order(make_transport: Callable[..., KafkaTransport]) -> None:
    sessions, per_session = 12, 25
    transport = make_transport(partitions=4)
    for seq in range(per_session):
        transport.admit([_turn(f"{s}:{seq}", session_id=f"session-{s}") for s in range(sessions)])
    total = sessions * per_session
    arrivals: list[tuple[str, int, str]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def worker(name: str) -> None:
        deadline = time.monotonic() + WAIT_S * 2
        while not stop.is_set() and time.monotonic() < deadline:
            for delivery in transport.claim(name, max_items=7, wait_s=0.2):
                session, seq = delivery.work_item_id.split(":")
                with lock:
                    arrivals.append((session, int(seq), name))
                transport.ack(delivery.receipt)
        transport.close_consumer()

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    _eventually(lambda: len({(s, q) for s, q, _ in arrivals}) >= total, "every turn", timeout=WAIT_S * 2)
    stop.set()
    for thread in threads:
        thread.join(timeout=WAIT_S)
    by_session: dict[str, list[int]] = {}
    for session, seq, _name in arrivals:
        by_session.setdefault(session, []).append(seq)
    assert len(by_session) == sessions
    for session, seqs in by_session.items():
        assert seqs == sorted(seqs), f"session {session} arrived out of order: {seqs}"
        assert sorted(set(seqs)) == list(range(per_session))


def test_acknowledging_with_another_threads_receipt_is_refused(
    make_transport: Callable[..., KafkaTransport],
) -> None:
    transport = make_transport()
    transport.admit([_turn("a")])
    (delivery,) = _claim_until(transport, 1)

    def intruder() -> list[str]:
        refused = []
        for attempt in (lambda: transport.ack(delivery.receipt), lambda: transport.release(delivery.receipt)):
            try:
                attempt()
            except Fenced:
                refused.append("fenced")
        return refused

    assert _in_thread(intruder) == ["fenced", "fenced"]
    # The owner still holds it, and another owner string on the same thread is refused too.
    forged = type(delivery.receipt)(owner="someone-else", token=delivery.receipt.token)
    with pytest.raises(Fenced):
        transport.ack(forged)
    transport.ack(delivery.receipt)
    with pytest.raises(Fenced):
        transport.ack(delivery.receipt)  # twice: the second is stale


def test_receipts_of_a_revoked_partition_are_fenced_and_redelivered_elsewhere(
    make_transport: Callable[..., KafkaTransport],
) -> None:
    transport = make_transport(partitions=2)
    transport.admit([_turn(f"t{i}", session_id=f"s{i}") for i in range(20)])
    held = _claim_until(transport, 20, max_items=20)
    by_id = {d.work_item_id: d for d in held}
    second_got: list[str] = []
    stop = threading.Event()

    def second() -> None:
        while not stop.is_set():
            for delivery in transport.claim("w2", max_items=20, wait_s=0.2):
                second_got.append(delivery.work_item_id)
                transport.ack(delivery.receipt)
        transport.close_consumer()

    thread = threading.Thread(target=second)
    thread.start()
    try:
        # The first consumer gives one partition up when it next polls; what it held there
        # (nothing acknowledged) goes to the second consumer from the committed offset.
        deadline = time.monotonic() + WAIT_S * 2
        while len(second_got) == 0:
            assert time.monotonic() < deadline, "the second consumer never received a partition"
            transport.claim("w", wait_s=0.2)
        _eventually(lambda: len(second_got) >= 1, "redelivery to the second consumer")
        time.sleep(1.0)  # let the rest of that partition arrive
    finally:
        stop.set()
        thread.join(timeout=WAIT_S)
    moved = set(second_got)
    assert moved and moved < set(by_id)
    for work_item_id in moved:
        with pytest.raises(Fenced):
            transport.ack(by_id[work_item_id].receipt)
    for work_item_id in set(by_id) - moved:
        transport.ack(by_id[work_item_id].receipt)


def test_admission_rejects_when_lag_reaches_the_bound(make_transport: Callable[..., KafkaTransport]) -> None:
    transport = make_transport(max_depth=5, probe_cache_s=0.1)
    transport.admit([_turn(f"t{i}") for i in range(3)])
    with pytest.raises(QueueFull):
        transport.admit([_turn(f"x{i}") for i in range(3)])  # all or nothing: 3 + 3 > 5
    transport.admit([_turn("t3"), _turn("t4")])
    with pytest.raises(QueueFull):
        transport.admit([_turn("t5")])
    time.sleep(0.2)  # a fresh probe (not this process's bookkeeping) still says 5
    assert transport.depth() == 5
    with pytest.raises(QueueFull):
        transport.admit([_turn("t5")])
    # Recovery re-drive ignores the bound.
    transport.admit([_turn("t0")], bounded=False)
    got = _claim_until(transport, 6)
    for delivery in got[:3]:
        transport.ack(delivery.receipt)
    transport.claim("w", wait_s=0)  # flushes the commit
    _eventually(lambda: transport.depth() == 3, "lag 3 after three acknowledgements")
    transport.admit([_turn("t6"), _turn("t7")])
    with pytest.raises(QueueFull):
        transport.admit([_turn("t8")])


def test_concurrent_admission_never_exceeds_the_bound(make_transport: Callable[..., KafkaTransport]) -> None:
    bound, threads, attempts = 40, 16, 8
    transport = make_transport(partitions=3, max_depth=bound)
    barrier = threading.Barrier(threads)

    def submitter(index: int) -> tuple[int, int]:
        accepted = rejected = 0
        barrier.wait(timeout=WAIT_S)
        for attempt in range(attempts):
            try:
                transport.admit([_turn(f"{index}:{attempt}", session_id=f"s{index}")])
                accepted += 1
            except QueueFull:
                rejected += 1
        return accepted, rejected

    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = list(pool.map(submitter, range(threads), timeout=WAIT_S * 3))
    accepted = sum(a for a, _ in results)
    assert sum(r for _, r in results) == threads * attempts - accepted
    # Within one process the reservations are exact; the probe may only over-count (reject more).
    assert bound - threads <= accepted <= bound
    _eventually(lambda: transport.depth() == accepted, "the lag to match the accepted turns")


def test_admission_rejects_when_the_broker_is_stopped(
    make_transport: Callable[..., KafkaTransport], kafka_broker: KafkaBroker
) -> None:
    transport = make_transport(probe_timeout_s=2.0, probe_cache_s=0.1, delivery_timeout_s=5.0)
    transport.admit([_turn("before")])
    kafka_broker.stop()
    try:
        time.sleep(0.2)  # past the probe cache: only a fresh probe may answer
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(DepthUnavailable):
                transport.admit([_turn("during")])
            assert time.monotonic() - started < 10.0
        with pytest.raises(DepthUnavailable):
            transport.depth()
    finally:
        kafka_broker.start()
    _eventually(lambda: _admits(transport), "admission after the broker is back", timeout=60)
    assert transport.depth() >= 2


def test_close_is_bounded_while_the_broker_is_down_and_loses_nothing(
    make_transport: Callable[..., KafkaTransport],
    kafka_broker: KafkaBroker,
    kafka_bootstrap: str,
    kafka_topic_name: str,
) -> None:
    """A worker must exit within its grace after SIGTERM even while the broker is down: close()
    may not wait for the group coordinator (librdkafka's synchronous commit waits up to the
    session timeout, per consumer). What it could not confirm is redelivered, never lost."""
    group = f"g.{kafka_topic_name}"
    # Session timeout = visibility timeout (6 s): before, each consumer's close waited that long.
    transport = make_transport(visibility_timeout_s=6.0, close_timeout_s=2.0)
    transport.admit([_turn(f"t{i}") for i in range(4)])
    claimed, joined, closed = threading.Event(), threading.Event(), threading.Event()

    def holder() -> None:
        # A worker thread with its own consumer: t0 acknowledged, the rest withheld. It stays
        # alive (an exited thread's consumer is closed by the committer) until close() is done.
        got = _claim_until(transport, 4, owner="w")
        assert [d.work_item_id for d in got] == ["t0", "t1", "t2", "t3"]
        transport.ack(got[0].receipt)
        claimed.set()
        closed.wait(timeout=WAIT_S * 3)

    def idle() -> None:
        transport.claim("w2", wait_s=0.5)  # a second consumer in the group (no partition to get)
        joined.set()
        closed.wait(timeout=WAIT_S * 3)

    threads = [threading.Thread(target=holder), threading.Thread(target=idle)]
    threads[0].start()
    assert claimed.wait(timeout=WAIT_S * 2)
    threads[1].start()
    assert joined.wait(timeout=WAIT_S)
    _eventually(lambda: _committed(kafka_bootstrap, group, kafka_topic_name) == {0: 1}, "t0 committed")
    kafka_broker.stop()
    try:
        started = time.monotonic()
        transport.close()
        took = time.monotonic() - started
    finally:
        closed.set()
        kafka_broker.start()
        for thread in threads:
            thread.join(timeout=WAIT_S)
    assert took < 2.0 + 1.5, f"close() took {took:.1f} s with the broker down"
    # Nothing lost: the withheld turns come back to the next consumer of the group.
    after = make_transport(visibility_timeout_s=6.0)
    got = _in_thread(lambda: _claim_until(after, 3, owner="next", timeout=WAIT_S * 3), timeout=WAIT_S * 4)
    assert sorted(d.work_item_id for d in got) == ["t1", "t2", "t3"]


def test_close_leaves_the_group_also_for_a_consumer_without_partitions(
    make_transport: Callable[..., KafkaTransport], kafka_bootstrap: str, kafka_topic_name: str
) -> None:
    """Two worker threads on one partition: one consumer holds it, the other holds nothing. After
    close() the group is empty at once. librdkafka's close alone sent no LeaveGroup for the member
    without partitions, and the group kept it until its session timeout (45 s); every rebalance
    waited for it meanwhile, so the partitions of workers that did leave sat idle too."""
    group = f"g.{kafka_topic_name}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})

    def members() -> int:
        described = admin.describe_consumer_groups([group])[group].result(timeout=10)
        return len(described.members)

    transport = make_transport(partitions=1)
    joined, closed = threading.Barrier(3), threading.Event()

    def worker_thread() -> None:
        transport.claim("w", wait_s=0.5)  # this thread's consumer joins the group
        joined.wait(timeout=WAIT_S)
        while not closed.is_set():
            try:
                transport.claim("w", wait_s=0.2)
            except BackendUnavailable:
                return  # close() has begun

    threads = [threading.Thread(target=worker_thread) for _ in range(2)]
    for thread in threads:
        thread.start()
    joined.wait(timeout=WAIT_S)
    _eventually(lambda: members() == 2, "both consumers in the group")
    try:
        transport.close()
    finally:
        closed.set()
        for thread in threads:
            thread.join(timeout=WAIT_S)
    # Well inside the session timeout (45 s): only a LeaveGroup empties the group this soon.
    _eventually(lambda: members() == 0, "the group empty after close()", timeout=5.0)


def test_close_waits_for_the_consumer_the_committer_is_closing(
    make_transport: Callable[..., KafkaTransport], kafka_broker: KafkaBroker
) -> None:
    """A worker exits right after close(). The committer closes the consumer of a thread that has
    exited (the worker's claim threads end before close() is called), and that close, cut short by
    the exit, sent no LeaveGroup: the group kept the member until its session timeout, and its
    partitions' turns waited 45 s for another worker (seen when the HPA scaled workers down). So
    close() waits for that close too, within its own bound. The paused broker holds the close."""
    transport = make_transport(close_timeout_s=5.0)
    transport.admit([_turn("t0")])

    def worker_thread() -> None:
        (delivery,) = _claim_until(transport, 1)
        transport.ack(delivery.receipt)

    _in_thread(worker_thread)  # the thread is gone: its consumer is the committer's to close
    kafka_broker.pause()
    try:
        time.sleep(1.5)  # the committer looks every second: it is inside that close now
        started = time.monotonic()
        transport.close()
        took = time.monotonic() - started
    finally:
        kafka_broker.resume()
    # Before: the committer was given at most 1 s, and close() returned while its close went on.
    assert 2.0 < took < 5.0 + 1.5, f"close() took {took:.1f} s"


def _admits(transport: KafkaTransport) -> bool:
    try:
        transport.admit([_turn("after")])
    except DepthUnavailable:
        return False
    return True


def test_concurrent_admits_are_coalesced_and_all_confirmed(
    make_transport: Callable[..., KafkaTransport],
) -> None:
    transport = make_transport(partitions=3)
    threads, per_thread = 32, 25
    barrier = threading.Barrier(threads)

    def submitter(index: int) -> int:
        barrier.wait(timeout=WAIT_S)
        for seq in range(per_thread):
            transport.admit([_turn(f"{index}:{seq}", session_id=f"s{index}")])
        # And a put_many batch from every thread.
        transport.admit([_turn(f"{index}:batch:{i}", session_id=f"s{index}") for i in range(5)])
        return per_thread + 5

    with ThreadPoolExecutor(max_workers=threads) as pool:
        admitted = sum(pool.map(submitter, range(threads), timeout=WAIT_S * 3))
    assert admitted == threads * (per_thread + 5)
    _eventually(lambda: transport.depth() == admitted, "every admitted turn counted in the lag")
    got = _claim_until(transport, admitted, max_items=200, timeout=WAIT_S * 2)
    assert len({d.work_item_id for d in got}) == admitted


def test_ensure_topic_creates_grows_and_refuses_a_decrease(
    kafka_bootstrap: str, kafka_topic_name: str
) -> None:
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    assert ensure_topic(admin, kafka_topic_name, 2).action == "created"
    assert ensure_topic(admin, kafka_topic_name, 2).action == "unchanged"
    grown = ensure_topic(admin, kafka_topic_name, 3)
    assert (grown.action, grown.before, grown.partitions) == ("grown", 2, 3)
    _eventually(lambda: topic_partition_count(admin, kafka_topic_name) == 3, "three partitions")
    with pytest.raises(PartitionDecreaseRefused):
        ensure_topic(admin, kafka_topic_name, 1)
    assert topic_partition_count(admin, kafka_topic_name) == 3


def test_depth_probe_of_a_missing_topic_is_unavailable_not_zero(
    kafka_bootstrap: str, kafka_topic_name: str
) -> None:
    reader = offsets_reader(kafka_bootstrap, "nobody")
    try:
        with pytest.raises(DepthUnavailable):
            consumer_group_lag(kafka_topic_name, "nobody", timeout_s=5, reader=reader)
    finally:
        reader.close()


class _LosesCommits:
    """The thread's librdkafka consumer, except that asynchronous commits vanish without an error
    while ``losing`` is set (as one sent to a group coordinator that moved during a restart)."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer
        self.losing = True
        self.lost = 0

    def commit(self, *args: Any, **kwargs: Any) -> Any:
        if self.losing and kwargs.get("asynchronous", True):
            self.lost += 1
            return None
        return self._consumer.commit(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


@pytest.mark.parametrize("refresh_s", [0.5])
def test_a_commit_lost_without_an_error_is_sent_again(
    make_transport: Callable[..., KafkaTransport],
    kafka_bootstrap: str,
    kafka_topic_name: str,
    refresh_s: float,
) -> None:
    """An idle partition's acknowledged turns leave the lag even when the commit that carried
    them never reached the broker and no callback said so: the position is sent again."""
    group = f"g.{kafka_topic_name}"
    transport = make_transport(commit_interval_s=0.0, commit_refresh_s=0.5)
    transport.admit([_turn(f"t{i}") for i in range(4)])
    got = _claim_until(transport, 4)
    (consumer,) = transport._consumers._list()
    lossy = _LosesCommits(consumer.consumer)
    consumer.consumer = lossy
    for delivery in got:
        transport.ack(delivery.receipt)
    transport.claim("w", wait_s=0)
    assert lossy.lost >= 1
    assert _committed(kafka_bootstrap, group, kafka_topic_name)[0] < 4  # the commit vanished
    lossy.losing = False
    # Nothing moves any more: only the refresh sends the position again, at some later claim.
    deadline = time.monotonic() + WAIT_S
    while _committed(kafka_bootstrap, group, kafka_topic_name)[0] != 4:
        assert time.monotonic() < deadline, "the lost commit was never sent again"
        transport.claim("w", wait_s=0.2)
    _eventually(lambda: transport.depth() == 0, "depth 0 once the position is committed")
