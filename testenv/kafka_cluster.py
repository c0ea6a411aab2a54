"""A throwaway replicated Apache Kafka cluster: three KRaft nodes (broker+controller each) on loopback.

Replication factor 3 and ``min.insync.replicas=2`` by default, so an ``acks=all`` write survives
one lost broker and is refused while two are gone. The nodes are :class:`testenv.kafka.KafkaBroker`
processes sharing one cluster id and one static voter set; each runs with a small heap (three
JVMs on a 2-core test machine) and short KRaft timeouts, so leader elections take about a second
and a dead or paused broker is fenced within a few.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Self

from testenv._common import ServiceUnavailable, free_port, progress
from testenv.kafka import KAFKA_VERSION, START_TIMEOUT_S, KafkaBroker, _quiet_logger, _random_cluster_id

#: Three JVMs share the machine with the tests: a small heap each (a node idles at ~150 MiB).
NODE_HEAP = (
    "-Xms64m",
    "-Xmx384m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:ParallelGCThreads=1",
    "-XX:ConcGCThreads=1",
    # C1 only: a restarted node serves in about two thirds of the time on a busy 2-core machine
    # (less compiling); a test cluster never runs long enough for C2 to pay off.
    "-XX:TieredStopAtLevel=1",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)

log = logging.getLogger(__name__)


def cluster_config(size: int, replication_factor: int, min_insync: int) -> dict[str, str]:
    """Server settings every node shares (on top of :class:`KafkaBroker`'s single-node ones)."""
    return {
        # What production clusters run with, and what the durability claims rest on.
        "default.replication.factor": str(replication_factor),
        "min.insync.replicas": str(min_insync),
        "unclean.leader.election.enable": "false",
        # The internal topics as durable as the data: committed offsets survive a lost broker too.
        "offsets.topic.replication.factor": str(replication_factor),
        "transaction.state.log.replication.factor": str(replication_factor),
        "transaction.state.log.min.isr": str(min_insync),
        "share.coordinator.state.topic.replication.factor": str(replication_factor),
        "share.coordinator.state.topic.min.isr": str(min_insync),
        # Fast failure detection, so elections happen within the chaos suite's seconds: a silent
        # controller is replaced after ~1 s, a dead or paused broker is fenced after 4 s (its
        # partitions' leadership moves then), a follower that stops fetching leaves the ISR after 4 s.
        "controller.quorum.election.timeout.ms": "1000",
        "controller.quorum.fetch.timeout.ms": "2000",
        "controller.quorum.election.backoff.max.ms": "500",
        "controller.quorum.request.timeout.ms": "2000",
        "broker.session.timeout.ms": "4000",
        "broker.heartbeat.interval.ms": "1000",
        # A starting broker exits ("fatal error while waiting for the controller to acknowledge
        # that we are caught up") when the quorum has not registered it in time: 60 s by default,
        # which two nodes restarted together on a loaded 2-core machine exceeded in the soak.
        # Waiting is testenv's job (START_TIMEOUT_S), so the broker waits as long.
        "initial.broker.registration.timeout.ms": str(START_TIMEOUT_S * 1000),
        "replica.lag.time.max.ms": "4000",
        "replica.socket.timeout.ms": "5000",
        "controller.socket.timeout.ms": "5000",
        # Fewer threads per JVM: three nodes on two cores.
        "num.network.threads": "2",
        "num.io.threads": "2",
        "num.replica.fetchers": "1",
        "background.threads": "2",
        "log.cleaner.enable": "false",
        "num.partitions": str(size),
    }


class KafkaCluster:
    """``size`` KRaft nodes on 127.0.0.1; ``bootstrap`` lists them all.

    Faults for tests: :meth:`kill` (SIGKILL) and :meth:`start_node`, :meth:`pause` (SIGSTOP) and
    :meth:`resume`, :meth:`restart` of every node, and :meth:`leader_of` a partition.
    """

    NAME = "Kafka cluster"

    def __init__(
        self,
        size: int = 3,
        *,
        replication_factor: int = 3,
        min_insync: int = 2,
        version: str = KAFKA_VERSION,
        extra_config: Mapping[str, str] | None = None,
    ) -> None:
        if not 1 <= min_insync <= replication_factor <= size:
            raise ValueError("need 1 <= min_insync <= replication_factor <= size")
        self.size = size
        self.replication_factor = replication_factor
        self.min_insync = min_insync
        self.version = f"Apache Kafka {version} ({size} KRaft nodes)"
        config = {**cluster_config(size, replication_factor, min_insync), **(extra_config or {})}
        self.nodes = [
            KafkaBroker(version, node_id=i, extra_config=config, heap=NODE_HEAP) for i in range(1, size + 1)
        ]
        self._lock = threading.RLock()
        self._started = False

    # -- addresses ---------------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    def node(self, node_id: int) -> KafkaBroker:
        return self.nodes[node_id - 1]

    @property
    def running(self) -> bool:
        """Every node's process is up (paused or not)."""
        return self._started and all(node.running for node in self.nodes)

    def running_ids(self) -> list[int]:
        return [node.node_id for node in self.nodes if node.running]

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Self:
        """Start every node that is not running and wait until each serves as a broker."""
        with self._lock:
            if not self._started:
                self._first_start()
                self._started = True
                return self
            self._start_nodes([n for n in self.nodes if not n.running])
            return self

    def _first_start(self) -> None:
        progress(f"starting a {self.size}-node KRaft cluster")
        cluster_id = _random_cluster_id()
        # Ports for every node first: each node's voter list names all the controllers.
        ports = [(free_port(), free_port()) for _ in self.nodes]
        voters = ",".join(f"{n.node_id}@127.0.0.1:{c}" for n, (_, c) in zip(self.nodes, ports, strict=True))
        for node, (port, controller) in zip(self.nodes, ports, strict=True):
            node.port, node.controller_port = port, controller
            node.voters, node.cluster_id = voters, cluster_id
            node._prepare()  # formats its storage with the shared cluster id
        self._start_nodes(self.nodes)

    def _start_nodes(self, nodes: Iterable[KafkaBroker]) -> None:
        # Every JVM first, then wait: no node serves before a quorum of controllers has formed.
        nodes = list(nodes)
        for node in nodes:
            node.spawn()
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            for node in nodes:
                node.wait_serving(timeout=max(1.0, deadline - time.monotonic()))
        except ServiceUnavailable:
            for node in nodes:
                node.stop(immediate=True)
            raise

    def start_node(self, node_id: int) -> None:
        """Start one stopped node again (same directory and ports) and wait until it serves."""
        with self._lock:
            node = self.node(node_id)
            if not node.running:
                self._start_nodes([node])

    def kill(self, node_id: int) -> None:
        """SIGKILL one node: no controlled shutdown, its leadership moves once it is fenced."""
        self.node(node_id).stop(immediate=True)

    def pause(self, node_id: int) -> None:
        self.node(node_id).pause()

    def resume(self, node_id: int) -> None:
        self.node(node_id).resume()

    def stop(self, *, immediate: bool = False) -> None:
        with self._lock:
            for node in self.nodes:
                node.resume()
            if immediate:
                for node in self.nodes:
                    node.stop(immediate=True)
                return
            # Controlled shutdowns in parallel: one after the other, the last node would wait for
            # a controller quorum that the earlier ones took away.
            threads = [threading.Thread(target=node.stop) for node in self.nodes]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

    def restart(self, *, immediate: bool = False) -> None:
        """Every node down (controlled, or SIGKILL), then every node up again."""
        with self._lock:
            self.stop(immediate=immediate)
            self._start_nodes(self.nodes)

    def close(self) -> None:
        with self._lock:
            self.stop(immediate=True)
            for node in self.nodes:
                node.close()
            self._started = False

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what tests ask the cluster ----------------------------------------------------------

    def _admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        live = [n.bootstrap for n in self.nodes if n.running] or [self.bootstrap]
        return AdminClient(
            {
                "bootstrap.servers": ",".join(live),
                "logger": _quiet_logger(),
                "socket.connection.setup.timeout.ms": 2000,
            }
        )

    def partitions(self, topic: str, timeout: float = 10.0) -> dict[int, tuple[int, list[int], list[int]]]:
        """partition -> (leader node id or -1, replicas, in-sync replicas), as the cluster reports."""
        metadata = self._admin().list_topics(topic=topic, timeout=timeout)
        found = metadata.topics.get(topic)
        if found is None or found.error is not None:
            raise ServiceUnavailable(f"topic {topic}: {found.error if found else 'not found'}")
        return {p.id: (p.leader, list(p.replicas), list(p.isrs)) for p in found.partitions.values()}

    def leader_of(self, topic: str, partition: int = 0, timeout: float = 10.0) -> int:
        """The node leading ``partition`` of ``topic``; waits out a leaderless moment."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                leader = self.partitions(topic, timeout=max(1.0, deadline - time.monotonic()))[partition][0]
                if leader > 0:
                    return leader
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"no leader for {topic}[{partition}] within {timeout:g}s")
            time.sleep(0.2)

    def wait_fully_replicated(
        self, topic: str, timeout: float = 60.0
    ) -> dict[int, tuple[int, list[int], list[int]]]:
        """Until every partition of ``topic`` has a leader and all its replicas in sync; returns
        :meth:`partitions`. Nodes learn metadata at their own pace (one just restarted may not
        know a new topic yet), so an unknown topic is waited for like an out-of-sync replica."""
        deadline = time.monotonic() + timeout
        state: Any = None
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                state = self.partitions(topic, timeout=5)
                if all(leader > 0 and set(isr) == set(reps) for leader, reps, isr in state.values()):
                    return dict(state)
            time.sleep(0.25)
        raise ServiceUnavailable(f"{topic} not fully replicated within {timeout:g}s: {state}")


__all__ = ["NODE_HEAP", "KafkaCluster", "cluster_config"]
