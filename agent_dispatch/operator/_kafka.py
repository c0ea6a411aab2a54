"""The operator's view of Kafka topic management: create, grow, never shrink.

The administration itself is the transport's (:mod:`agent_dispatch.transports.kafka`); this
module turns its outcomes into what the reconcile loop reports: a decrease is a ``refused``
result rather than an error, and an unreachable broker is :class:`KafkaUnavailable`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from confluent_kafka.admin import AdminClient

from agent_dispatch.errors import BackendUnavailable, DepthUnavailable
from agent_dispatch.transports import kafka

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


def _admin(bootstrap_servers: str) -> AdminClient:
    return kafka.admin_client(
        bootstrap_servers, client_id="agent-dispatch-operator", socket_timeout_s=REQUEST_TIMEOUT_S
    )


def ensure_topic(
    bootstrap_servers: str, topic: str, partitions: int, replication_factor: int | None = None
) -> TopicResult:
    """Create ``topic`` with ``partitions``, or grow it to ``partitions``; refuse a decrease."""
    try:
        change = kafka.ensure_topic(
            _admin(bootstrap_servers),
            topic,
            partitions,
            replication_factor=replication_factor,
            timeout_s=REQUEST_TIMEOUT_S,
        )
    except kafka.PartitionDecreaseRefused as exc:
        return TopicResult(
            "refused",
            exc.current,
            f"topic {topic} has {exc.current} partitions; spec.partitions {partitions} would decrease it "
            "(partitions are grow-only); nothing changed",
        )
    except BackendUnavailable as exc:
        raise KafkaUnavailable(str(exc)) from None
    if change.action == "created":
        return TopicResult("created", partitions, f"created topic {topic} with {partitions} partitions")
    if change.action == "grown":
        return TopicResult(
            "grown", partitions, f"grew topic {topic} from {change.before} to {partitions} partitions"
        )
    return TopicResult("unchanged", change.partitions, f"topic {topic} has {change.partitions} partitions")


def describe_topic(bootstrap_servers: str, topic: str) -> int | None:
    """Partition count of ``topic`` (None if missing); raises :class:`KafkaUnavailable`."""
    try:
        return kafka.topic_partition_count(_admin(bootstrap_servers), topic, timeout_s=REQUEST_TIMEOUT_S)
    except BackendUnavailable as exc:
        raise KafkaUnavailable(str(exc)) from None


def consumer_lag(bootstrap_servers: str, topic: str, group: str) -> int | None:
    """Queue depth on Kafka: the consumer group's lag summed over the topic's partitions (a
    partition the group never committed counts from its low watermark). None if the topic is
    missing; raises :class:`KafkaUnavailable` when the broker cannot be asked."""
    admin = _admin(bootstrap_servers)
    try:
        if kafka.topic_partition_count(admin, topic, timeout_s=REQUEST_TIMEOUT_S) is None:
            return None
        reader = kafka.offsets_reader(bootstrap_servers, group)
        try:
            return kafka.consumer_group_lag(topic, group, timeout_s=REQUEST_TIMEOUT_S, reader=reader)
        finally:
            reader.close()
    except (BackendUnavailable, DepthUnavailable) as exc:
        raise KafkaUnavailable(str(exc)) from None
