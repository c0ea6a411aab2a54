"""The replicated test cluster (testenv.kafka_cluster) and the project's producer on it.

Three KRaft nodes, replication factor 3, ``min.insync.replicas=2``: the topic the project creates
gets three replicas, the producer is idempotent with ``acks=all``, an acknowledged message
survives its partition leader's SIGKILL, and with two brokers gone the producer refuses
(``DeliveryFailed``, the gateway's 503) instead of confirming a message one broker holds.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import ConfigResource

from agent_dispatch.errors import DepthUnavailable
from agent_dispatch.transport import OutboundTurn
from agent_dispatch.transports.kafka import KafkaTuning, admin_client, ensure_topic
from agent_dispatch.transports.kafka._admin import GroupLag
from agent_dispatch.transports.kafka._producer import ConfirmingProducer, DeliveryFailed
from testenv.kafka_cluster import KafkaCluster

pytestmark = pytest.mark.kafka

PARTITIONS = 4


@pytest.fixture
def topic(kafka_cluster: KafkaCluster) -> Iterator[str]:
    name = f"test.cluster.{uuid.uuid4().hex[:8]}"
    yield name
    kafka_cluster.start()  # every node up again for the tests after this one


def _turns(prefix: str, count: int) -> list[OutboundTurn]:
    return [OutboundTurn(f"{prefix}-{i}", f"s{i % 7}", "t", f"{prefix}-{i}".encode()) for i in range(count)]


def _read_all(bootstrap: str, topic: str) -> set[bytes]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"read-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,
        }
    )
    try:
        parts = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=30)[1] for tp in parts}
        consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        seen: set[bytes] = set()
        positions = dict.fromkeys(ends, 0)
        deadline = time.monotonic() + 60
        while any(positions[p] < ends[p] for p in ends) and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error() is not None:
                continue
            seen.add(message.value() or b"")
            positions[message.partition()] = message.offset() + 1
        return seen
    finally:
        consumer.close()


def _topic_config(admin: Any, topic: str) -> dict[str, Any]:
    # The node that answers may have restarted a moment ago and not know the topic yet.
    deadline = time.monotonic() + 30
    while True:
        try:
            described = admin.describe_configs([ConfigResource("topic", topic)])
            return dict(next(iter(described.values())).result(timeout=10))
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _depth_probes_stay_quiet(cluster: KafkaCluster, topic: str) -> None:
    """With two brokers of three down, the depth probe (what the gateway's admission, the
    operator's metrics and the HPA read, every few hundred milliseconds) answers within its
    timeout, a number or ``DepthUnavailable``, and does not busy-loop meanwhile. Through the
    AdminClient's ``list_offsets`` it took about 1.5 cores of this process while the dead leaders'
    broker threads reconnected without backoff (see ``_admin._watermarks``); that starved the
    brokers' restart on a 2-core machine. The bound is CPU time, a third of the wall time: the
    old probe used over four times the wall time."""
    lag = GroupLag(cluster.bootstrap, topic, f"probe-{uuid.uuid4().hex[:6]}")
    answers: list[str] = []
    cpu, wall = time.process_time(), time.monotonic()
    try:
        while time.monotonic() - wall < 4.0:
            started = time.monotonic()
            try:
                answers.append(str(lag.measure(timeout_s=2.0)))
            except DepthUnavailable:
                answers.append("unavailable")
            assert time.monotonic() - started < 2.0 + 3.0, answers
            time.sleep(0.2)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        lag.close(5.0)
    assert answers
    assert cpu < wall / 3, f"{cpu:.2f} s of CPU in {wall:.1f} s of depth probes ({answers})"


def test_replicated_topic_survives_a_leader_kill_and_refuses_without_quorum(
    kafka_cluster: KafkaCluster, topic: str
) -> None:
    cluster = kafka_cluster
    admin = admin_client(cluster.bootstrap)
    # The transport's own call (KafkaTransport.ensure_ready): no replication factor given, so the
    # cluster's default (3) applies; the operator passes spec.kafka.replicationFactor when set.
    ensure_topic(admin, topic, PARTITIONS)
    partitions = cluster.wait_fully_replicated(topic)
    assert len(partitions) == PARTITIONS
    assert {len(replicas) for _leader, replicas, _isr in partitions.values()} == {3}
    assert _topic_config(admin, topic)["min.insync.replicas"].value == "2"

    def producer(delivery_timeout_s: float) -> ConfirmingProducer:
        tuning = KafkaTuning(delivery_timeout_s=delivery_timeout_s)
        return ConfirmingProducer(cluster.bootstrap, topic, tuning, on_unsent=lambda _count: None)

    # Long enough to ride out a leader election (the dead leader is fenced after 4 s).
    patient, hasty = producer(20.0), producer(4.0)
    settings = patient._config()
    assert settings["enable.idempotence"] is True and settings["acks"] == "all"
    try:
        patient.send(_turns("before", 20))

        leader = cluster.leader_of(topic, 0)
        cluster.kill(leader)
        patient.send(_turns("after-leader-kill", 20))  # two in-sync replicas remain: confirmed

        second = next(node for node in cluster.running_ids() if node != leader)
        cluster.kill(second)
        started = time.monotonic()
        with pytest.raises(DeliveryFailed):
            hasty.send(_turns("one-broker", 1))
        # Refused within the delivery timeout and the producer's own margin, not hung.
        assert time.monotonic() - started < 4.0 + 10.0 + 5.0
        _depth_probes_stay_quiet(cluster, topic)

        cluster.start()
        patient.send(_turns("restarted", 20))
    finally:
        patient.close(10.0)
        hasty.close(1.0)

    stored = _read_all(cluster.bootstrap, topic)
    confirmed = {
        t.wire for prefix in ("before", "after-leader-kill", "restarted") for t in _turns(prefix, 20)
    }
    assert confirmed <= stored, sorted(confirmed - stored)[:5]


def test_depth_probe_answers_again_once_a_leaderless_partition_has_a_leader(
    kafka_cluster: KafkaCluster, topic: str
) -> None:
    """A reader that measured while a partition had no leader measures again once it has one.

    One replica, so the partition is leaderless while its node is down. librdkafka keeps a
    leaderless partition in the reader's metadata cache as a permanent error; before the probe
    refreshed that cache itself, this reader answered ``_UNKNOWN_PARTITION`` for minutes after
    the node was back, and the gateway refused every turn (seen in the replicated chaos run)."""
    cluster = kafka_cluster
    ensure_topic(admin_client(cluster.bootstrap), topic, 1, replication_factor=1)
    leader = cluster.leader_of(topic)
    cluster.kill(leader)
    deadline = time.monotonic() + 30
    while cluster.partitions(topic)[0][0] != -1:
        assert time.monotonic() < deadline, cluster.partitions(topic)
        time.sleep(0.2)
    lag = GroupLag(cluster.bootstrap, topic, f"probe-{uuid.uuid4().hex[:6]}")
    try:
        with pytest.raises(DepthUnavailable, match="no leader"):
            lag.measure(timeout_s=2.0)
        cluster.start_node(leader)
        assert cluster.leader_of(topic, timeout=30) == leader
        answers: list[str] = []
        deadline = time.monotonic() + 20
        while not answers or answers[-1] != "0":
            assert time.monotonic() < deadline, answers
            try:
                answers.append(str(lag.measure(timeout_s=2.0)))
            except DepthUnavailable as exc:
                answers.append(str(exc))
            time.sleep(0.2)
    finally:
        lag.close(5.0)
