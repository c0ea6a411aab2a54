"""Kafka topic management through confluent_kafka's AdminClient: create, grow, never shrink.

Kafka cannot remove partitions, and re-keying sessions onto fewer partitions would break the
one-session-one-partition ordering, so a spec below the topic's partition count is refused
before any call that changes the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewPartitions, NewTopic

#: AdminClient calls are bounded so a dead broker shows as TransportReachable=False promptly
#: instead of stalling the reconcile loop.
REQUEST_TIMEOUT_S: Final = 15.0

TopicAction = Literal["created", "grown", "unchanged", "refused"]


@dataclass(frozen=True)
class TopicResult:
    action: TopicAction
    partitions: int
    """Partitions the topic has after the call (for ``refused``: the count it kept)."""
    message: str


class KafkaUnavailable(RuntimeError):
    """The broker could not be asked; the message carries the client's error, not addresses."""


def admin_config(bootstrap_servers: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap_servers,
        "client.id": "agent-dispatch-operator",
        "socket.timeout.ms": int(REQUEST_TIMEOUT_S * 1000),
        "logger": _SilentLogger(),
    }


class _SilentLogger:
    """librdkafka logs connection failures with broker addresses to stderr; the operator reports
    reachability through conditions instead, so its logs never carry addresses either."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        return None

    def debug(self, *args: Any, **kwargs: Any) -> None:
        return None

    def info(self, *args: Any, **kwargs: Any) -> None:
        return None

    def warning(self, *args: Any, **kwargs: Any) -> None:
        return None

    def error(self, *args: Any, **kwargs: Any) -> None:
        return None


def _admin(bootstrap_servers: str) -> AdminClient:
    return AdminClient(admin_config(bootstrap_servers))


def topic_partitions(admin: AdminClient, topic: str) -> int | None:
    """The topic's partition count, or None if it does not exist."""
    try:
        metadata = admin.list_topics(topic=topic, timeout=REQUEST_TIMEOUT_S)
    except KafkaException as exc:
        raise KafkaUnavailable(f"cannot list topics: {exc.args[0].str() if exc.args else exc}") from None
    found = metadata.topics.get(topic)
    if found is None or found.error is not None:
        return None
    return len(found.partitions)


def ensure_topic(
    bootstrap_servers: str, topic: str, partitions: int, replication_factor: int | None = None
) -> TopicResult:
    """Create ``topic`` with ``partitions``, or grow it to ``partitions``; refuse a decrease."""
    admin = _admin(bootstrap_servers)
    current = topic_partitions(admin, topic)
    if current is None:
        futures = admin.create_topics(
            [NewTopic(topic, num_partitions=partitions, replication_factor=replication_factor or -1)],
            request_timeout=REQUEST_TIMEOUT_S,
        )
        try:
            futures[topic].result(timeout=REQUEST_TIMEOUT_S)
        except KafkaException as exc:
            error = exc.args[0]
            # Another operator replica (or a restarted one) created it in between: not an error.
            if getattr(error, "name", lambda: "")() != "TOPIC_ALREADY_EXISTS":
                raise KafkaUnavailable(f"cannot create topic {topic}: {error.str()}") from None
            return ensure_topic(bootstrap_servers, topic, partitions, replication_factor)
        return TopicResult("created", partitions, f"created topic {topic} with {partitions} partitions")
    if partitions < current:
        return TopicResult(
            "refused",
            current,
            f"topic {topic} has {current} partitions; spec.partitions {partitions} would decrease it "
            "(partitions are grow-only); nothing changed",
        )
    if partitions == current:
        return TopicResult("unchanged", current, f"topic {topic} has {current} partitions")
    futures = admin.create_partitions([NewPartitions(topic, partitions)], request_timeout=REQUEST_TIMEOUT_S)
    try:
        futures[topic].result(timeout=REQUEST_TIMEOUT_S)
    except KafkaException as exc:
        raise KafkaUnavailable(f"cannot grow topic {topic}: {exc.args[0].str()}") from None
    return TopicResult("grown", partitions, f"grew topic {topic} from {current} to {partitions} partitions")


def describe_topic(bootstrap_servers: str, topic: str) -> int | None:
    """Partition count of ``topic`` (None if missing); raises :class:`KafkaUnavailable`."""
    return topic_partitions(_admin(bootstrap_servers), topic)


def consumer_lag(bootstrap_servers: str, topic: str, group: str) -> int | None:
    """Queue depth on Kafka: the consumer group's lag summed over the topic's partitions (a
    partition the group never committed counts from its low watermark). None if the topic is
    missing; raises :class:`KafkaUnavailable` when the broker cannot be asked."""
    admin = _admin(bootstrap_servers)
    count = topic_partitions(admin, topic)
    if count is None:
        return None
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": group,
            "enable.auto.commit": False,
            "logger": _SilentLogger(),
        }
    )
    try:
        parts = [TopicPartition(topic, p) for p in range(count)]
        committed = consumer.committed(parts, timeout=REQUEST_TIMEOUT_S)
        lag = 0
        for tp in committed:
            low, high = consumer.get_watermark_offsets(
                TopicPartition(topic, tp.partition), timeout=REQUEST_TIMEOUT_S
            )
            start = tp.offset if tp.offset >= 0 else low
            lag += max(0, high - start)
        return lag
    except KafkaException as exc:
        raise KafkaUnavailable(
            f"cannot read consumer lag: {exc.args[0].str() if exc.args else exc}"
        ) from None
    finally:
        consumer.close()
