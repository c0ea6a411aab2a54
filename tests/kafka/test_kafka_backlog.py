"""Which work items still have a delivery queued on the topic (``_backlog.queued_work_items``), on a
real KRaft broker: what a re-drive must not duplicate, and what it must re-drive."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from agent_dispatch import dispatch
from agent_dispatch.models import SubmitRequest
from agent_dispatch.settings import load
from agent_dispatch.stores.sqlite import SqliteStore
from agent_dispatch.transport import Delivery, OutboundTurn
from agent_dispatch.transports.kafka import KafkaTransport, KafkaTuning
from agent_dispatch.transports.kafka._backlog import queued_work_items

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]


def _turns(ids: list[str]) -> list[OutboundTurn]:
    return [OutboundTurn(work_item_id=i, session_id=i, tenant="t", wire=i.encode()) for i in ids]


@pytest.fixture
def transport(kafka_bootstrap: str, kafka_topic_name: str) -> Iterator[KafkaTransport]:
    settings = load(
        backend_choice="kafka",
        kafka_bootstrap_servers=kafka_bootstrap,
        kafka_topic=kafka_topic_name,
        kafka_group=f"g.{kafka_topic_name}",
        partitions=3,
    )
    made = KafkaTransport(settings, tuning=KafkaTuning())
    made.ensure_ready()
    yield made
    made.close()


def _queued(transport: KafkaTransport) -> frozenset[str] | None:
    return transport.queued_work_items()


def _records(transport: KafkaTransport) -> int:
    """Records ever written to the topic (the sum of its high watermarks)."""
    reader = Consumer({"bootstrap.servers": transport.bootstrap_servers, "group.id": "watermarks"})
    try:
        return sum(
            reader.get_watermark_offsets(TopicPartition(transport.topic, p), timeout=10)[1] for p in range(3)
        )
    finally:
        reader.close()


def _claim(transport: KafkaTransport, count: int) -> list[Delivery]:
    out: list[Delivery] = []
    deadline = time.monotonic() + 20
    while len(out) < count and time.monotonic() < deadline:
        out += transport.claim("w", max_items=count - len(out), wait_s=0.5)
    assert len(out) == count, [d.work_item_id for d in out]
    return out


def _on_one_thread(fn: Callable[[], Any]) -> Any:
    """Consumers are per thread: every claim and ack of a test runs on this one."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result(timeout=60)


def test_a_backlog_that_nobody_consumed_is_all_queued(transport: KafkaTransport) -> None:
    assert _queued(transport) == frozenset()
    ids = [f"j{i}" for i in range(12)]
    transport.admit(_turns(ids))
    assert _queued(transport) == frozenset(ids)


def test_acknowledged_turns_are_not_queued_and_held_or_released_ones_are(
    transport: KafkaTransport,
) -> None:
    ids = [f"j{i}" for i in range(9)]
    transport.admit(_turns(ids))

    def work() -> tuple[set[str], set[str], set[str]]:
        deliveries = _claim(transport, 9)
        by_id = {d.work_item_id: d for d in deliveries}
        acked = {"j0", "j1", "j2", "j5", "j8"}
        released = {"j3"}
        for job in sorted(acked):
            transport.ack(by_id[job].receipt)
        for job in released:
            transport.release(by_id[job].receipt, delay_s=60)
        # Idle: the committer sends the prefix and the metadata of what was acknowledged past it.
        time.sleep(1.0)
        held = set(ids) - acked - released
        return acked, released, held

    acked, released, held = _on_one_thread(work)
    queued = _queued(transport)
    assert queued is not None
    # Acknowledged (also past the committed prefix, from the commit's metadata): gone.
    assert queued & acked == set()
    # Held by a worker or released for later: the group delivers them again without a re-drive.
    assert queued == released | held


def test_a_redrive_of_everything_adds_only_what_is_not_queued(transport: KafkaTransport) -> None:
    """What the recovery sweep does with it: of a stale batch, only turns without a queued delivery
    are produced again, so the lag (the autoscaling signal) counts each waiting turn once."""
    ids = [f"j{i}" for i in range(6)]
    transport.admit(_turns(ids))

    def consume_two() -> None:
        for delivery in _claim(transport, 6):
            if delivery.work_item_id in {"j0", "j1"}:
                transport.ack(delivery.receipt)
            else:
                transport.release(delivery.receipt, delay_s=0)
        time.sleep(1.0)

    _on_one_thread(consume_two)
    queued = _queued(transport)
    assert queued == frozenset(ids[2:])
    again = [turn for turn in _turns(ids) if turn.work_item_id not in queued]
    transport.admit(again, bounded=False)
    assert [t.work_item_id for t in again] == ["j0", "j1"]
    # One record per waiting turn: 6 first deliveries, 2 re-driven.
    assert _records(transport) == 8
    assert _queued(transport) == frozenset(ids)


def test_an_unreachable_broker_gives_no_answer_rather_than_an_empty_one() -> None:
    assert queued_work_items("127.0.0.1:1", "t", "g", timeout_s=1.0) is None


def test_the_recovery_sweep_re_drives_only_turns_without_a_queued_message(
    transport: KafkaTransport, tmp_path: Path
) -> None:
    """``dispatch.redrive`` on Kafka: turns waiting behind a backlog keep their one message (the lag
    counts each once), a turn whose message never made it is produced again, and every turn looked
    at is stamped dispatched so the next sweep leaves it alone for another ``stale_after_s``."""
    key = b"backlog-sweep-test-signing-key-0123456789abcdef"
    settings = load(
        backend_choice="kafka",
        kafka_bootstrap_servers=transport.bootstrap_servers,
        kafka_topic=transport.topic,
        kafka_group=transport.group,
        partitions=3,
        signing_key=key.decode(),
        data_dir=tmp_path,
    )
    store = SqliteStore(tmp_path / "store.sqlite3", settings)
    store.migrate()
    try:
        waiting = [
            dispatch.enqueue(store, transport, _request(f"wait-{i}"), signing_key=key, settings=settings)
            for i in range(5)
        ]
        # Stored, but its produce never happened (a process that died between the two).
        lost = store.submit(_request("lost")).item
        assert _records(transport) == 5

        sent = dispatch.redrive(store, transport, settings=settings, signing_key=key, stale_after_s=0)
        assert sent == 1
        assert _records(transport) == 6
        assert _queued(transport) == frozenset([r.item.id for r in waiting] + [lost.id])
        # All six were stamped: a sweep at the default threshold finds nothing stale.
        assert store.recoverable(stale_after_s=60) == []
    finally:
        store.close()


def _request(key: str) -> SubmitRequest:
    return SubmitRequest(tenant="t", kind="chat", payload=b'{"text":"hi"}', idempotency_key=key)
