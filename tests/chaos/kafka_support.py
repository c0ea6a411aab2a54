"""Kafka in the chaos suite: the replicated cluster's faults and figures, and diagnostics that name
what a Kafka run left behind (committed offsets, uncommitted messages and their WorkItems).

Replicated faults (``kafka-replicated``, a :class:`testenv.kafka_cluster.KafkaCluster` of three
nodes, replication factor 3, ``min.insync.replicas=2``):

- ``leader_kill``: SIGKILL the leader of a random partition of the run's topic, start it again
  1-2 s later (soak: 1-3 s; leadership moves to an in-sync follower; nothing acknowledged is lost);
- ``two_brokers_kill``: SIGKILL two of the three, start them again after 3-5 s (soak: 3-45 s,
  at times past the producer's 30 s delivery timeout). Meanwhile no write can reach two in-sync replicas, so
  the gateway must not answer a fresh 202: it answers 503 once the delivery times out (or the
  request waits and is accepted after the brokers return, durably);
- ``cluster_restart``: every node down (controlled, or SIGKILL), then every node up;
- ``broker_pause``: SIGSTOP one node for 5-6 s (soak: 5-9 s; past its 4 s broker session, so it is fenced and
  its leaderships move), then SIGCONT: a network partition as its peers and clients see it.

While fewer than ``min.insync.replicas`` brokers run unpaused the harness notes a *quorum-lost
window*; :func:`fresh_accepts_without_quorum` is the check that no request sent inside one was
answered ``202 created`` inside it.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from testenv.kafka_cluster import KafkaCluster
    from tests.chaos.harness import ChaosRun

REPLICATED = "kafka-replicated"
REPLICATED_FAULTS = ("leader_kill", "two_brokers_kill", "cluster_restart", "broker_pause")
#: A soak holds two brokers down long enough, at times, for the producer's 30 s delivery timeout.
SOAK_FROM_S = 120.0


class QuorumWatch:
    """Wall-clock windows during which fewer than min.insync.replicas brokers could acknowledge."""

    def __init__(self, cluster: KafkaCluster) -> None:
        self.cluster = cluster
        self.paused: set[int] = set()
        self.windows: list[tuple[float, float]] = []
        self._since: float | None = None

    def able(self) -> int:
        return len([i for i in self.cluster.running_ids() if i not in self.paused])

    def changed(self) -> None:
        """Call after a node went away (the window opens) and *before* one comes back (it closes
        before the node can serve: conservative, a 202 a moment later is not judged)."""
        lost = self.able() < self.cluster.min_insync
        now = time.time()
        if lost and self._since is None:
            self._since = now
        elif not lost and self._since is not None:
            self.windows.append((self._since, now))
            self._since = None

    def closing(self) -> None:
        """A node is about to start or resume: whatever happens next, the window ends now."""
        if self._since is not None:
            self.windows.append((self._since, time.time()))
            self._since = None


def inject_replicated(run: ChaosRun, kind: str) -> None:
    cluster: KafkaCluster = run.services.kafka
    watch: QuorumWatch = run.quorum
    topic = run.backend.env["AGENT_DISPATCH_KAFKA_TOPIC"]
    rng = run.rng
    started = time.monotonic()
    if kind == "leader_kill":
        partition = rng.randrange(int(run.backend.env["AGENT_TURNS_PARTITIONS"]))
        leader = cluster.leader_of(topic, partition)
        cluster.kill(leader)
        watch.changed()
        down = round(rng.uniform(1.0, 3.0 if long_outages(run) else 2.0), 2)
        time.sleep(down)
        watch.closing()
        cluster.start_node(leader)
        watch.changed()
        run.record(kind, node=leader, partition=partition, down_s=down, took_s=_since(started))
    elif kind == "two_brokers_kill":
        victims = sorted(rng.sample(cluster.running_ids(), 2))
        for node in victims:
            cluster.kill(node)
        watch.changed()
        down = round(rng.uniform(3.0, 45.0) if long_outages(run) else rng.uniform(3.0, 5.0), 2)
        time.sleep(down)
        watch.closing()
        cluster.start()
        watch.changed()
        run.record(kind, nodes=victims, down_s=down, took_s=_since(started))
    elif kind == "cluster_restart":
        immediate = rng.random() < 0.5
        cluster.stop(immediate=immediate)
        watch.changed()
        watch.closing()
        cluster.start()
        watch.changed()
        run.record(kind, immediate=immediate, took_s=_since(started))
    elif kind == "broker_pause":
        node = rng.choice(cluster.running_ids())
        pause = round(rng.uniform(5.0, 9.0 if long_outages(run) else 6.0), 2)
        cluster.pause(node)
        watch.paused.add(node)
        watch.changed()
        time.sleep(pause)
        watch.closing()
        watch.paused.discard(node)
        cluster.resume(node)
        watch.changed()
        run.record(kind, node=node, pause_s=pause)
    else:
        raise AssertionError(f"unknown fault {kind}")


def long_outages(run: ChaosRun) -> bool:
    """Soak: outages as long as the docstring says; short mode keeps each near its minimum."""
    return run.duration_s >= SOAK_FROM_S


def _since(started: float) -> float:
    return round(time.monotonic() - started, 2)


def _in_windows(run: ChaosRun) -> list[tuple[float, float]]:
    watch: QuorumWatch | None = getattr(run, "quorum", None)
    return list(watch.windows) if watch is not None else []


def fresh_accepts_without_quorum(run: ChaosRun) -> list[str]:
    """Keys answered ``202 created`` by a request sent and answered inside one quorum-lost window:
    such a turn was never on two in-sync replicas, so the producer acknowledged what it must not."""
    windows = _in_windows(run)
    found = []
    for stats in run.clients:
        for key, sent, answered, status, created in stats.answers:
            if status == 202 and created and any(a <= sent and answered <= b for a, b in windows):
                found.append(f"{key} (sent {sent - run.wall0:.1f}s, answered {answered - run.wall0:.1f}s)")
    return found


def replicated_figures(run: ChaosRun) -> dict[str, Any]:
    """The report's replicated-Kafka figures: quorum-lost time, what clients were told meanwhile."""
    if run.name != REPLICATED:
        return {}
    windows = _in_windows(run)
    during: Counter[str] = Counter()
    for stats in run.clients:
        for _key, _sent, answered, status, created in stats.answers:
            if any(a <= answered <= b for a, b in windows):
                during[f"{status}/created={created}" if status == 202 else str(status)] += 1
    cluster: KafkaCluster = run.services.kafka
    replicas: list[int] = []
    with contextlib.suppress(Exception):
        replicas = sorted(
            {
                len(r)
                for _l, r, _i in cluster.partitions(run.backend.env["AGENT_DISPATCH_KAFKA_TOPIC"]).values()
            }
        )
    return {
        "quorum_lost_windows": len(windows),
        "quorum_lost_s": round(sum(b - a for a, b in windows), 1),
        "answers_while_quorum_lost": dict(sorted(during.items())),
        "topic_replication_factors": replicas,
    }


def topic_messages(env: Mapping[str, str], seed: int) -> int | None:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": env["KAFKA_BOOTSTRAP_SERVERS"], "group.id": f"chaos-count-{seed}"}
    )
    try:
        topic = env["AGENT_DISPATCH_KAFKA_TOPIC"]
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions
        )
    except Exception:
        return None
    finally:
        consumer.close()


def kafka_diagnosis(run: ChaosRun) -> str:
    """Per partition: committed offset, high watermark; and the group's members."""
    from confluent_kafka import Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient

    env = run.backend.env
    group = env["AGENT_DISPATCH_KAFKA_GROUP"]
    topic = env["AGENT_DISPATCH_KAFKA_TOPIC"]
    consumer = Consumer({"bootstrap.servers": env["KAFKA_BOOTSTRAP_SERVERS"], "group.id": group})
    try:
        parts = [
            TopicPartition(topic, p) for p in consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ]
        committed = {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=10)}
        high = {tp.partition: consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in parts}
        admin = AdminClient({"bootstrap.servers": env["KAFKA_BOOTSTRAP_SERVERS"]})
        described = admin.describe_consumer_groups([group])[group].result(timeout=10)
        members = [
            (m.client_id, sorted(tp.partition for tp in m.assignment.topic_partitions))
            for m in described.members
        ]
        pending = uncommitted_messages(
            run, [(p, committed[p], high[p]) for p in sorted(high) if 0 <= committed[p] < high[p]]
        )
        return (
            f"committed {committed} high {high} state {described.state} members {members}; "
            f"uncommitted messages {pending}"
        )
    except Exception as exc:
        return f"no diagnosis: {exc!r}"
    finally:
        consumer.close()


def uncommitted_messages(run: ChaosRun, spans: list[tuple[int, int, int]]) -> list[str]:
    """What lies past the committed offsets: the message's time, its WorkItem and that item's state."""
    from confluent_kafka import Consumer, TopicPartition

    from agent_dispatch.transports.kafka import WORK_ITEM_HEADER

    env = run.backend.env
    reader = Consumer(
        {
            "bootstrap.servers": env["KAFKA_BOOTSTRAP_SERVERS"],
            "group.id": f"chaos-diagnosis-{run.seed}",
            "enable.auto.commit": False,
        }
    )
    found: list[str] = []
    try:
        for partition, first, end in spans:
            reader.assign([TopicPartition(env["AGENT_DISPATCH_KAFKA_TOPIC"], partition, first)])
            offset, deadline = first, time.monotonic() + 10
            while offset < min(end, first + 20) and time.monotonic() < deadline:
                message = reader.poll(1.0)
                if message is None or message.error() is not None:
                    continue
                offset = message.offset() + 1
                item_id = dict(message.headers() or []).get(WORK_ITEM_HEADER, b"").decode()
                with contextlib.suppress(Exception):
                    item_id += f" {run.store.get(item_id).state.value}"
                at = time.monotonic() - (time.time() - message.timestamp()[1] / 1000) - run.t0
                found.append(f"{partition}@{message.offset()} t={at:.1f}s {item_id}")
    finally:
        reader.close()
    return found
