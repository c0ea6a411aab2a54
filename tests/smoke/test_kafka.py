"""The loopback Kafka is a real KRaft broker: topics, produce/consume in a group, grow-only partitions."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

from testenv.kafka import KafkaBroker

pytestmark = pytest.mark.kafka

TIMEOUT_S = 30.0


def _admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap})


def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    # Keep the client referenced until the future resolves: a collected client fails its futures.
    admin = _admin(bootstrap)
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=partitions, replication_factor=1)], operation_timeout=TIMEOUT_S
    )
    futures[topic].result(timeout=TIMEOUT_S)


def _partition_count(bootstrap: str, topic: str) -> int:
    metadata = _admin(bootstrap).list_topics(topic, timeout=TIMEOUT_S)
    return len(metadata.topics[topic].partitions)


def _wait_for_partitions(bootstrap: str, topic: str, expected: int) -> int:
    # Metadata reaches the broker's cache shortly after the controller commits the change.
    deadline = time.monotonic() + TIMEOUT_S
    count = _partition_count(bootstrap, topic)
    while count != expected and time.monotonic() < deadline:
        time.sleep(0.2)
        count = _partition_count(bootstrap, topic)
    return count


def _produce(bootstrap: str, topic: str, key: bytes, value: bytes) -> None:
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            errors.append(err)

    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})
    producer.produce(topic, key=key, value=value, on_delivery=on_delivery)
    assert producer.flush(TIMEOUT_S) == 0, "message was not delivered in time"
    assert errors == []


def _consume_one(bootstrap: str, topic: str, group: str) -> Message:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            consumer.commit(message=msg, asynchronous=False)
            return msg
        pytest.fail(f"no message from {topic} within {TIMEOUT_S}s")
    finally:
        consumer.close()


def test_produce_and_consume_in_a_consumer_group(kafka_bootstrap: str, kafka_topic_name: str) -> None:
    _create_topic(kafka_bootstrap, kafka_topic_name, partitions=1)
    _produce(kafka_bootstrap, kafka_topic_name, b"session-1", b"hello")

    msg = _consume_one(kafka_bootstrap, kafka_topic_name, group=f"{kafka_topic_name}.group")

    assert (msg.key(), msg.value()) == (b"session-1", b"hello")


def test_partitions_grow_and_a_decrease_is_refused(kafka_bootstrap: str, kafka_topic_name: str) -> None:
    _create_topic(kafka_bootstrap, kafka_topic_name, partitions=2)
    admin = _admin(kafka_bootstrap)

    grow = admin.create_partitions([NewPartitions(kafka_topic_name, 4)], operation_timeout=TIMEOUT_S)
    grow[kafka_topic_name].result(timeout=TIMEOUT_S)
    assert _wait_for_partitions(kafka_bootstrap, kafka_topic_name, 4) == 4

    shrink = admin.create_partitions([NewPartitions(kafka_topic_name, 3)], operation_timeout=TIMEOUT_S)
    with pytest.raises(KafkaException) as refused:
        shrink[kafka_topic_name].result(timeout=TIMEOUT_S)
    assert refused.value.args[0].code() == KafkaError.INVALID_PARTITIONS
    assert _partition_count(kafka_bootstrap, kafka_topic_name) == 4


def test_auto_topic_creation_is_off(kafka_bootstrap: str, kafka_topic_name: str) -> None:
    # Tests must create their topics explicitly, as the operator does in production.
    metadata = _admin(kafka_bootstrap).list_topics(kafka_topic_name, timeout=TIMEOUT_S)
    assert metadata.topics[kafka_topic_name].error is not None


def test_restart_keeps_address_and_messages(kafka_broker: KafkaBroker, kafka_topic_name: str) -> None:
    bootstrap = kafka_broker.bootstrap
    _create_topic(bootstrap, kafka_topic_name, partitions=1)
    _produce(bootstrap, kafka_topic_name, b"k", b"survives")

    kafka_broker.restart()

    assert kafka_broker.bootstrap == bootstrap
    msg = _consume_one(bootstrap, kafka_topic_name, group=f"{kafka_topic_name}.group")
    assert msg.value() == b"survives"
