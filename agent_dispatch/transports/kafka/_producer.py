"""Producing: one idempotent producer (``acks=all``) shared by every admitting thread.

Concurrent sends (and the batches they carry) are coalesced behind one delivery-confirmed flush
barrier run by a background flusher thread; every message carries its own delivery callback, so
each caller learns its own result and returns only once the broker has acknowledged all of its
messages.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from agent_dispatch.errors import BackendUnavailable
from agent_dispatch.transport import OutboundTurn
from agent_dispatch.transports.kafka._client import client_config, describe
from agent_dispatch.transports.kafka._config import WORK_ITEM_HEADER, KafkaTuning

log = logging.getLogger(__name__)


class DeliveryFailed(BackendUnavailable):
    """The broker did not confirm every message of an admission: the outcome is unknown.

    A backend failure (the gateway answers 503): with ``acks=all`` and an idempotent producer a
    timed-out message may still have been written. The enqueue path leaves such WorkItems ready
    and undispatched, so the recovery sweep re-drives them and a retry with the same idempotency
    key finds them; a worker that meets a second copy skips it against the WorkItem's lease.
    """


class _Batch:
    """One send's messages: wakes the caller once every message has a delivery report.

    Reports arrive on the flusher thread while the caller may still be settling messages that
    never reached librdkafka, so the count is kept lock-free: every message owns one entry of a
    deque, each report pops one (``deque.pop`` is atomic), and whoever pops the sentinel placed
    at the far end is the last and opens the latch.
    """

    __slots__ = ("_flusher", "_pending", "count", "done", "errors")

    _LAST: Final = -1

    def __init__(self, count: int, flusher: _Flusher) -> None:
        self._flusher = flusher
        self.count = count
        self._pending: collections.deque[int] = collections.deque([_Batch._LAST])
        self._pending.extend(itertools.repeat(0, count - 1))
        self.errors: list[str] = []
        # A plain lock used as a one-shot latch: cheaper than an Event on the hot path.
        self.done = threading.Lock()
        self.done.acquire()

    @property
    def remaining(self) -> int:
        return len(self._pending)

    def settle(self, error: str | None) -> None:
        if error is not None:
            self.errors.append(error)
        if self._pending.pop() == _Batch._LAST:
            self.done.release()

    def on_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        # Only the flusher thread serves reports, so this counter has a single writer.
        self._flusher.reported += 1
        self.settle(None if err is None else err.name())


class _Flusher:
    """The one flush barrier: a thread that drives delivery reports for every admitting thread.

    Admitting threads only enqueue into librdkafka and wait on their own latch. This thread calls
    ``flush()``, which sends whatever has accumulated at once (ignoring linger) and serves the
    delivery callbacks as the broker's acknowledgements arrive, so one round trip confirms the
    messages of every caller that joined while the previous request was in flight.
    """

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self._wake = threading.Event()
        #: True while the thread waits for work; admitters only pay for a wake-up then.
        self._idle = True
        self._stopping = False
        #: Delivery reports served (success or failure); written by this thread only.
        self.reported = 0
        self._thread = threading.Thread(target=self._run, name="kafka-flusher", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        if self._idle:
            self._wake.set()

    def _run(self) -> None:
        producer = self._producer
        while not self._stopping:
            self._wake.wait(0.5)
            # Order matters: clear the event, declare busy, then look at the queue. An admitter
            # that enqueued before len() is seen by it; one that enqueues after the loop below
            # declares idle sees _idle and sets the event again.
            self._wake.clear()
            self._idle = False
            try:
                while len(producer) > 0 and not self._stopping:
                    try:
                        producer.flush(0.1)
                    except Exception:  # a callback bug must not kill the only thread serving reports
                        log.exception("kafka delivery report handling failed")
            finally:
                self._idle = True
            if len(producer) > 0:
                self._wake.set()  # enqueued between the last len() and _idle = True

    def stop(self, timeout_s: float) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)


class ConfirmingProducer:
    """Sends turns and returns once the broker confirmed each one; created on first use.

    ``on_unsent(count)`` hears of messages that never reached librdkafka (so no delivery report
    will ever count them): whoever keeps the admission books settles them there.
    """

    def __init__(
        self, bootstrap_servers: str, topic: str, tuning: KafkaTuning, on_unsent: Callable[[int], None]
    ) -> None:
        self._bootstrap_servers = bootstrap_servers
        self._topic = topic
        self._tuning = tuning
        self._on_unsent = on_unsent
        self._lock = threading.Lock()
        self._refusing = False
        self._producer: Producer | None = None
        self._flusher: _Flusher | None = None

    @property
    def reported(self) -> int:
        """Delivery reports served so far (success or failure)."""
        flusher = self._flusher
        return 0 if flusher is None else flusher.reported

    def ready(self) -> tuple[Producer, _Flusher]:
        """The producer and its flusher, created if needed; ``BackendUnavailable`` once closing."""
        producer, flusher = self._producer, self._flusher
        if producer is not None and flusher is not None and not self._refusing:
            return producer, flusher
        with self._lock:
            if self._refusing:
                raise BackendUnavailable("kafka transport is closed")
            if self._producer is None or self._flusher is None:
                self._producer = Producer(self._config())
                self._flusher = _Flusher(self._producer)
            return self._producer, self._flusher

    def _config(self) -> dict[str, Any]:
        tuning = self._tuning
        return {
            **client_config(self._bootstrap_servers, "agent-dispatch-producer", "producer"),
            # Exactly-once per partition on retries, in order; acks=all is implied, but said.
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": tuning.linger_ms,
            "message.timeout.ms": int(tuning.delivery_timeout_s * 1000),
            # Same key -> same partition as Java clients (murmur2), so sessions stay put
            # whichever client produced them.
            "partitioner": "murmur2_random",
            "queue.buffering.max.messages": 1_000_000,
            "topic.metadata.refresh.interval.ms": 30_000,
            **tuning.producer_config,
        }

    def send(self, turns: Sequence[OutboundTurn]) -> None:
        """Produce ``turns``; returns once the broker confirmed every one, else :class:`DeliveryFailed`."""
        count = len(turns)
        try:
            producer, flusher = self.ready()
        except BaseException:
            self._on_unsent(count)
            raise
        batch = _Batch(count, flusher)
        on_delivery, produce, topic = batch.on_delivery, producer.produce, self._topic
        produced = 0
        try:
            for turn in turns:
                key, header = turn.session_id.encode(), [(WORK_ITEM_HEADER, turn.work_item_id.encode())]
                try:
                    produce(topic, turn.wire, key, headers=header, on_delivery=on_delivery)
                except BufferError:
                    self._produce_when_room(
                        producer, flusher, value=turn.wire, key=key, headers=header, on_delivery=on_delivery
                    )
                produced += 1
        except KafkaException as exc:
            raise DeliveryFailed(f"kafka refused the turn ({describe(exc)})") from None
        finally:
            if produced < count:
                # Never reached librdkafka: settle them here so the bookkeeping stays exact.
                self._on_unsent(count - produced)
                for _ in range(count - produced):
                    batch.settle("not enqueued")
            flusher.kick()
        if not batch.done.acquire(timeout=self._tuning.delivery_timeout_s + 10.0):
            raise DeliveryFailed(f"kafka did not confirm {batch.remaining} of {count} turns in time")
        if batch.errors:
            raise DeliveryFailed(
                f"kafka did not accept {len(batch.errors)} of {count} turns ({sorted(set(batch.errors))[0]})"
            )

    def _produce_when_room(
        self,
        producer: Producer,
        flusher: _Flusher,
        *,
        value: bytes,
        key: bytes,
        headers: list[tuple[str, bytes]],
        on_delivery: Any,
    ) -> None:
        """librdkafka's local queue is full: the flusher is draining it; retry until the deadline."""
        deadline = time.monotonic() + self._tuning.delivery_timeout_s
        while True:
            flusher.kick()
            time.sleep(0.002)
            try:
                producer.produce(self._topic, value, key, headers=headers, on_delivery=on_delivery)
                return
            except BufferError:
                if time.monotonic() > deadline:
                    raise DeliveryFailed("kafka producer queue stayed full") from None

    def refuse(self) -> None:
        """From now on :meth:`ready` and :meth:`send` refuse (the transport is closing)."""
        with self._lock:
            self._refusing = True

    def close(self, timeout_s: float) -> None:
        """Refuse new sends, stop the flusher and flush what is queued, within ``timeout_s``."""
        self.refuse()
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self._flusher is not None:
            self._flusher.stop(timeout_s=min(max(0.0, timeout_s), 1.0))
        if self._producer is not None:
            remaining = self._producer.flush(max(0.0, deadline - time.monotonic()))
            if remaining:
                log.warning("kafka producer closed with undelivered messages", extra={"count": remaining})
