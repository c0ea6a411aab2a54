"""Kafka administration, the one place for it: topics (create, grow, never shrink) and group lag.

The transport, the operator and the doctor all call these. Kafka cannot remove partitions, and
re-keying sessions onto fewer partitions would break one-session-one-partition ordering, so a
decrease is refused before any call that changes the cluster.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Final, Literal

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

from agent_dispatch.errors import BackendUnavailable, DepthUnavailable, DispatchError
from agent_dispatch.transports.kafka._client import client_config, describe, error_of

DEFAULT_ADMIN_TIMEOUT_S: Final = 15.0


class PartitionDecreaseRefused(DispatchError):
    """A requested partition count is below the topic's: Kafka partitions are grow-only."""

    def __init__(self, topic: str, current: int, requested: int) -> None:
        super().__init__(
            f"topic {topic} has {current} partitions; {requested} would decrease it "
            "(partitions are grow-only); nothing changed"
        )
        self.topic = topic
        self.current = current
        self.requested = requested


@dataclass(frozen=True)
class TopicChange:
    action: Literal["created", "grown", "unchanged"]
    #: Partitions before the call (None: the topic did not exist).
    before: int | None
    partitions: int


def admin_client(
    bootstrap_servers: str,
    *,
    client_id: str = "agent-dispatch-admin",
    socket_timeout_s: float | None = None,
) -> AdminClient:
    """An AdminClient that logs like our other clients (no broker addresses above DEBUG)."""
    config: dict[str, Any] = client_config(bootstrap_servers, client_id, "admin")
    if socket_timeout_s is not None:
        config["socket.timeout.ms"] = int(socket_timeout_s * 1000)
    return AdminClient(config)


def topic_partition_count(
    admin: AdminClient, topic: str, *, timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S
) -> int | None:
    """The topic's partition count, None if it does not exist; ``BackendUnavailable`` if unreachable."""
    try:
        metadata = admin.list_topics(topic=topic, timeout=timeout_s)
    except KafkaException as exc:
        raise BackendUnavailable(f"kafka: cannot read topic metadata ({describe(exc)})") from None
    found = metadata.topics.get(topic)
    if found is None or (found.error is not None and not found.partitions):
        return None
    return len(found.partitions)


def ensure_topic(
    admin: AdminClient,
    topic: str,
    partitions: int,
    *,
    replication_factor: int | None = None,
    timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S,
) -> TopicChange:
    """Create ``topic`` with ``partitions`` or grow it to that count; never shrink it.

    Raises :class:`PartitionDecreaseRefused` (before changing anything) when the topic already has
    more partitions, and ``BackendUnavailable`` when the cluster cannot be asked. A concurrent
    creator or grower (another replica, the operator) is not an error: the call re-reads and
    settles on the outcome.
    """
    if partitions < 1:
        raise ValueError("partitions must be at least 1")
    for _attempt in range(5):
        current = topic_partition_count(admin, topic, timeout_s=timeout_s)
        if current is None:
            new = NewTopic(topic, num_partitions=partitions, replication_factor=replication_factor or -1)
            future = admin.create_topics([new], request_timeout=timeout_s, operation_timeout=timeout_s)[topic]
            if _settle(
                future, timeout_s, retry_on=KafkaError.TOPIC_ALREADY_EXISTS, what=f"create topic {topic}"
            ):
                return TopicChange("created", None, partitions)
            continue
        if partitions < current:
            raise PartitionDecreaseRefused(topic, current, partitions)
        if partitions == current:
            return TopicChange("unchanged", current, current)
        future = admin.create_partitions([NewPartitions(topic, partitions)], request_timeout=timeout_s)[topic]
        # INVALID_PARTITIONS: somebody grew it in between; re-read and decide again.
        if _settle(future, timeout_s, retry_on=KafkaError.INVALID_PARTITIONS, what=f"grow topic {topic}"):
            return TopicChange("grown", current, partitions)
    raise BackendUnavailable(f"kafka: topic {topic} kept changing while it was being ensured")


def _settle(future: Any, timeout_s: float, *, retry_on: int, what: str) -> bool:
    """True when the admin operation succeeded, False when it lost a benign race (re-read)."""
    try:
        future.result(timeout=timeout_s + 1)
    except KafkaException as exc:
        err = error_of(exc)
        if err is not None and err.code() == retry_on:
            return False
        raise BackendUnavailable(f"kafka: cannot {what} ({describe(exc)})") from None
    except TimeoutError:
        raise BackendUnavailable(f"kafka: {what} timed out after {timeout_s:g} s") from None
    return True


def consumer_group_lag(topic: str, group: str, *, timeout_s: float, reader: Consumer) -> int:
    """Turns accepted on ``topic`` that ``group`` has not committed past, summed over partitions.

    A partition without a committed offset counts from its low watermark. Any failure, including a
    missing topic, raises :class:`DepthUnavailable` within about ``timeout_s``: an unknown depth is
    never reported as zero.

    The committed offsets are read with ``reader`` (see :func:`offsets_reader`), a Consumer whose
    group.id is ``group`` and that never subscribes, so it never joins the group. Not with the
    AdminClient's ListConsumerGroupOffsets: when the coordinator answers NOT_COORDINATOR (a fresh
    or restarted broker, a group it has not loaded yet) librdkafka dereferences the AdminClient's
    NULL group handle and the whole process dies with SIGSEGV (librdkafka issue #5040; seen here).

    The topic's metadata is read with ``reader`` too, on every measurement, because that request
    refreshes the reader's own metadata cache, which ``offsets_for_times`` finds the leaders in.
    librdkafka takes a cached partition without a leader (as during an election) for a permanent
    error and never refreshes it by itself: a reader that once saw a leaderless moment answered
    ``_UNKNOWN_PARTITION`` for every measurement after the leaders were back (seen here, for
    minutes, until ``metadata.max.age.ms``), and the gateway's admission refused every turn.
    """
    deadline = time.monotonic() + timeout_s

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    try:
        metadata = reader.list_topics(topic=topic, timeout=timeout_s)
        found = metadata.topics.get(topic)
        if found is None or found.error is not None:
            reason = found.error.name() if found is not None and found.error is not None else "missing"
            raise DepthUnavailable(f"kafka depth probe: topic {topic} is unavailable ({reason})")
        leaderless = sorted(p.id for p in found.partitions.values() if p.leader < 0)
        if leaderless:
            raise DepthUnavailable(f"kafka depth probe: no leader for partitions {leaderless} of {topic}")
        partitions = sorted(found.partitions)
        highs = _watermarks(reader, topic, partitions, OFFSET_END, remaining())
        lows = _watermarks(reader, topic, partitions, OFFSET_BEGINNING, remaining())
        committed = reader.committed([TopicPartition(topic, p) for p in partitions], timeout=remaining())
    except DepthUnavailable:
        raise
    except (KafkaException, TimeoutError) as exc:
        raise DepthUnavailable(f"kafka depth probe failed ({describe(exc)})") from None
    positions: dict[int, int] = {}
    for tp in committed or []:
        if tp.error is not None:
            raise DepthUnavailable(f"kafka depth probe failed ({tp.error.name()})")
        if tp.offset >= 0:
            positions[tp.partition] = tp.offset
    lag = 0
    for partition, high_mark in highs.items():
        low_mark = lows[partition]
        # A commit below the low watermark points at deleted records: count from what is left.
        start = max(positions.get(partition, low_mark), low_mark)
        lag += max(0, high_mark - start)
    return lag


def _watermarks(
    reader: Consumer, topic: str, partitions: list[int], which: int, timeout_s: float
) -> dict[int, int]:
    """Every partition's high (``OFFSET_END``) or low (``OFFSET_BEGINNING``) watermark, one request
    per leader: ListOffsets takes those two sentinels as its timestamp, as librdkafka's own
    watermark query does, so ``offsets_for_times`` answers for all partitions at once
    (``get_watermark_offsets`` asks one partition at a time: 64 partitions took 150-240 ms here,
    against 8-13 ms). Not with the AdminClient's ``list_offsets``: while a partition's leader is
    down, its broker threads reconnect without any backoff for as long as the request waits, about
    1,100 connection attempts a second and 1.5 cores with two brokers of three down (seen here;
    ``reconnect.backoff.ms`` did not change it), which starved the brokers' own restart."""
    found = reader.offsets_for_times([TopicPartition(topic, p, which) for p in partitions], timeout=timeout_s)
    marks: dict[int, int] = {}
    for tp in found:
        if tp.error is not None:
            raise DepthUnavailable(f"kafka depth probe failed ({tp.error.name()})")
        if tp.offset < 0:
            raise DepthUnavailable(f"kafka depth probe failed (no watermark for partition {tp.partition})")
        marks[tp.partition] = tp.offset
    return marks


def offsets_reader(bootstrap_servers: str, group: str) -> Consumer:
    """A Consumer that only reads ``group``'s committed offsets: it never subscribes or commits."""
    config = client_config(bootstrap_servers, "agent-dispatch-offsets", "offsets")
    return Consumer({**config, "group.id": group, "enable.auto.commit": False})


class GroupLag:
    """:func:`consumer_group_lag` with one offsets reader kept open between measurements.

    The reader is created on first use and used by one caller at a time (``measure`` serialises).
    """

    def __init__(self, bootstrap_servers: str, topic: str, group: str) -> None:
        self._bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.group = group
        self._lock = threading.Lock()
        self._reader: Consumer | None = None

    def measure(self, timeout_s: float) -> int:
        """The group's lag; :class:`DepthUnavailable` within about ``timeout_s`` if unknown."""
        with self._lock:
            if self._reader is None:
                self._reader = offsets_reader(self._bootstrap_servers, self.group)
            return consumer_group_lag(self.topic, self.group, timeout_s=timeout_s, reader=self._reader)

    def close(self, timeout_s: float) -> None:
        """Close the reader, giving up after ``timeout_s`` (a measurement in flight may hold it)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            return
        try:
            reader, self._reader = self._reader, None
        finally:
            self._lock.release()
        if reader is not None:
            closing = threading.Thread(target=reader.close, name="kafka-close-offsets", daemon=True)
            closing.start()
            closing.join(max(0.0, deadline - time.monotonic()))
