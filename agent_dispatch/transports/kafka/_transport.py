"""The facade: :class:`KafkaTransport` wires admin, admission, producer and consumers together."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from agent_dispatch.errors import BackendUnavailable, DepthUnavailable
from agent_dispatch.settings import Backend, Settings
from agent_dispatch.transport import Delivery, OutboundTurn, Receipt
from agent_dispatch.transports.kafka._admin import (
    GroupLag,
    PartitionDecreaseRefused,
    admin_client,
    ensure_topic,
)
from agent_dispatch.transports.kafka._admission import DepthBound
from agent_dispatch.transports.kafka._backlog import queued_work_items
from agent_dispatch.transports.kafka._config import KafkaTuning
from agent_dispatch.transports.kafka._consumer import ConsumerSpec
from agent_dispatch.transports.kafka._pool import ConsumerPool
from agent_dispatch.transports.kafka._producer import ConfirmingProducer

log = logging.getLogger(__name__)


class KafkaTransport:
    """:class:`agent_dispatch.transport.Transport` on Kafka (see the package docstring)."""

    backend = Backend.KAFKA

    def __init__(self, settings: Settings, *, tuning: KafkaTuning | None = None) -> None:
        if not settings.kafka_bootstrap_servers:
            raise BackendUnavailable("kafka: KAFKA_BOOTSTRAP_SERVERS is not set")
        self.settings = settings
        self.tuning = tuning or KafkaTuning()
        self.bootstrap_servers = settings.kafka_bootstrap_servers
        self.topic = settings.kafka_topic
        self.group = settings.kafka_group
        self.max_depth = settings.max_depth
        self.visibility_timeout_s = (
            self.tuning.visibility_timeout_s
            if self.tuning.visibility_timeout_s is not None
            else settings.effective_visibility_timeout_s
        )
        self._admin = admin_client(self.bootstrap_servers)
        self._lag = GroupLag(self.bootstrap_servers, self.topic, self.group)
        self._producer = ConfirmingProducer(
            self.bootstrap_servers, self.topic, self.tuning, on_unsent=self._release_reserved
        )
        self._bound = DepthBound(
            self.max_depth,
            measure=lambda: self._lag.measure(self.tuning.probe_timeout_s),
            delivered=lambda: self._producer.reported,
            cache_s=self.tuning.probe_cache_s,
        )
        self._consumers = ConsumerPool(
            ConsumerSpec(
                self.bootstrap_servers, self.group, self.topic, self.visibility_timeout_s, self.tuning
            )
        )
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_settings(cls, settings: Settings) -> KafkaTransport:
        """What :func:`agent_dispatch.transports.open_transport` calls."""
        return cls(settings)

    # -- lifecycle -------------------------------------------------------------------------------

    def ensure_ready(self) -> None:
        """Reach the cluster and make sure the topic exists with at least the configured partitions."""
        try:
            change = ensure_topic(
                self._admin, self.topic, self.settings.partitions, timeout_s=self.tuning.probe_timeout_s
            )
        except PartitionDecreaseRefused as exc:
            # The operator grew the topic beyond this process's setting: use what is there.
            log.info("kafka topic has more partitions than configured", extra={"partitions": exc.current})
        else:
            if change.action != "unchanged":
                log.info("kafka topic %s", change.action, extra={"partitions": change.partitions})
        # A new (or grown) topic answers offset requests only once every partition has a leader;
        # ready means the depth probe works, since admission depends on it.
        deadline = time.monotonic() + max(10.0, 2 * self.tuning.probe_timeout_s)
        while True:
            try:
                self._lag.measure(self.tuning.probe_timeout_s)
                return
            except DepthUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise BackendUnavailable(f"kafka: topic {self.topic} is not usable ({exc})") from None
                time.sleep(0.1)

    def close(self) -> None:
        """Commit and close every consumer, flush the producer (call after workers stop).

        Returns within ``tuning.close_timeout_s`` whatever the cluster does (a worker must exit
        within its shutdown grace even while the broker or the group coordinator is down): the
        consumers close in parallel, each abandoned at the deadline, and the producer's flush
        gets what is left. An undelivered message is the caller's ``DeliveryFailed`` (its
        WorkItem stays ready for the recovery sweep) or a re-drive the sweep repeats.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + self.tuning.close_timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        self._producer.refuse()
        self._consumers.close(left())
        self._producer.close(left())
        self._lag.close(left())

    def close_consumer(self) -> None:
        """Close the calling thread's consumer (a worker thread that exits calls this)."""
        self._consumers.close_mine()

    # -- admission -------------------------------------------------------------------------------

    def admit(self, turns: Sequence[OutboundTurn], *, bounded: bool = True) -> None:
        """Returns once the broker acknowledged every turn (``acks=all``), or raises.

        ``bounded``: the lag (plus this process's turns in flight) is checked against the bound,
        fail-closed; the enqueue path does not rely on it (its bound is the WorkItem store's count
        of unfinished items, ``agent_dispatch.dispatch.Counted``) and admits with ``bounded=False``.
        ``QueueFull``/``DepthUnavailable`` before anything is sent; ``DeliveryFailed`` when the
        broker did not confirm every turn (some may have been written: Kafka has no
        all-or-nothing produce without transactions). ``bounded=False`` skips the bound; Kafka
        cannot see whether a turn still has a queued delivery, so a re-drive may produce a second
        one, which the WorkItem lease turns into a no-op.
        """
        if not turns:
            return
        self._producer.ready()  # a closed transport refuses before anything is reserved
        if bounded:
            self._bound.reserve(len(turns))
        else:
            self._bound.count_unbounded(len(turns))
        self._produce(turns)

    def _produce(self, turns: Sequence[OutboundTurn]) -> None:
        """Produce turns already counted in flight; returns once the broker confirmed every one."""
        self._producer.send(turns)

    def _release_reserved(self, count: int) -> None:
        """Counted turns that will never be produced: settled like ones that never reached librdkafka."""
        self._bound.settle_unsent(count)

    def depth(self) -> int:
        return self._bound.depth()

    def queued_work_items(self) -> frozenset[str] | None:
        """Work items whose delivery the group will still hand out (``None``: unknown just now).

        For the recovery sweep: a ready WorkItem waiting behind a backlog still has its message
        on the topic, and a re-drive of it would be a second one, counted twice in the lag until
        both are consumed (see ``_backlog``). One pass over the unacknowledged records.
        """
        return queued_work_items(
            self.bootstrap_servers, self.topic, self.group, timeout_s=self.tuning.probe_timeout_s
        )

    # -- consuming -------------------------------------------------------------------------------

    def claim(self, owner: str, *, max_items: int = 1, wait_s: float = 0.0) -> list[Delivery]:
        if max_items < 1:
            return []
        return self._consumers.claim(owner, max_items=max_items, wait_s=wait_s)

    def ack(self, receipt: Receipt) -> None:
        self._consumers.ack(receipt)

    def release(self, receipt: Receipt, *, delay_s: float = 0.0) -> None:
        self._consumers.release(receipt, delay_s=delay_s)
