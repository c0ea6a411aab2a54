"""Kafka transport: topic ``agent_turns``, consumer group ``agent-dispatch``, key = session_id.

Producing: an idempotent producer (``acks=all``) shared by every admitting thread. Concurrent
:meth:`KafkaTransport.admit` calls (and the batches they carry) are coalesced behind one
delivery-confirmed flush barrier run by a background flusher thread; every message carries its own
delivery callback, so each caller learns its own result and returns only once the broker has
acknowledged all of its messages.

Admission: depth is the consumer group's lag (high watermark minus committed offset, summed over
the topic's partitions), measured with the AdminClient under a timeout. A failed or slow probe
raises :class:`DepthUnavailable`; it is never read as zero. The probe is cached for a fraction of
a second so admission costs the same at depth 0 and at depth 100k, and turns admitted by this
process since the probe began are added to it, so concurrent admitters in one process cannot
overshoot the bound between probes.

Consuming: one consumer per worker thread (created by that thread's first :meth:`claim`), manual
commits only. A receipt names the claiming owner and that consumer, and the assignment it was
issued under; any other thread, a revoked partition or an expired visibility window gets
:class:`Fenced`. Offsets are committed only up to each partition's contiguous acknowledged
prefix. A released delivery, or one held past the visibility timeout, is redelivered by seeking
the partition back to it once it is due; offsets acknowledged in between are skipped on the way
forward. The visibility timeout is also the consumer's ``max.poll.interval.ms``: a thread that
stops coming back is taken out of the group, and its partitions restart on another consumer
from the committed prefix, so nothing unacknowledged is ever skipped. Each commit's metadata
records what was delivered past the prefix and which of those were still unacknowledged, so
that next owner skips the acknowledged ones and counts redeliveries.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final, Literal

from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic, OffsetSpec

from agent_dispatch.errors import (
    BackendUnavailable,
    DepthUnavailable,
    DispatchError,
    Fenced,
    QueueFull,
)
from agent_dispatch.settings import Backend, Settings
from agent_dispatch.transport import Delivery, OutboundTurn, Receipt

log = logging.getLogger(__name__)
#: librdkafka's own log lines (they name broker addresses and repeat every reconnect attempt):
#: kept at DEBUG so a broker outage shows up through our typed errors, not a flood of lines.
_client_log = logging.getLogger(__name__ + ".client")

#: Header carrying the WorkItem id, so a worker can name the item without trusting the envelope.
WORK_ITEM_HEADER: Final = "agent-dispatch-work-item"
_RECEIPT_VERSION: Final = "kafka1"
_DEFAULT_ADMIN_TIMEOUT_S: Final = 15.0


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


class DeliveryFailed(BackendUnavailable):
    """The broker did not confirm every message of an admission: the outcome is unknown.

    A backend failure (the gateway answers 503): with ``acks=all`` and an idempotent producer a
    timed-out message may still have been written. The enqueue path leaves such WorkItems ready
    and undispatched, so the recovery sweep re-drives them and a retry with the same idempotency
    key finds them; a worker that meets a second copy skips it against the WorkItem's lease.
    """


# -- topic administration (shared with the operator) ---------------------------------------


@dataclass(frozen=True)
class TopicChange:
    action: Literal["created", "grown", "unchanged"]
    #: Partitions before the call (None: the topic did not exist).
    before: int | None
    partitions: int


def _error_of(exc: BaseException) -> KafkaError | None:
    arg = exc.args[0] if exc.args else None
    return arg if isinstance(arg, KafkaError) else None


def _describe(exc: BaseException) -> str:
    """An error text without broker addresses: the client error's name and reason."""
    err = _error_of(exc)
    if err is not None:
        return f"{err.name()}: {err.str()}"
    return type(exc).__name__ if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"


def topic_partition_count(
    admin: AdminClient, topic: str, *, timeout_s: float = _DEFAULT_ADMIN_TIMEOUT_S
) -> int | None:
    """The topic's partition count, None if it does not exist; ``BackendUnavailable`` if unreachable."""
    try:
        metadata = admin.list_topics(topic=topic, timeout=timeout_s)
    except KafkaException as exc:
        raise BackendUnavailable(f"kafka: cannot read topic metadata ({_describe(exc)})") from None
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
    timeout_s: float = _DEFAULT_ADMIN_TIMEOUT_S,
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
        err = _error_of(exc)
        if err is not None and err.code() == retry_on:
            return False
        raise BackendUnavailable(f"kafka: cannot {what} ({_describe(exc)})") from None
    except TimeoutError:
        raise BackendUnavailable(f"kafka: {what} timed out after {timeout_s:g} s") from None
    return True


def consumer_group_lag(
    admin: AdminClient, topic: str, group: str, *, timeout_s: float, reader: Consumer
) -> int:
    """Turns accepted on ``topic`` that ``group`` has not committed past, summed over partitions.

    A partition without a committed offset counts from its low watermark. Any failure, including a
    missing topic, raises :class:`DepthUnavailable` within about ``timeout_s``: an unknown depth is
    never reported as zero.

    The committed offsets are read with ``reader`` (see :func:`offsets_reader`), a Consumer whose
    group.id is ``group`` and that never subscribes, so it never joins the group. Not with the
    AdminClient's ListConsumerGroupOffsets: when the coordinator answers NOT_COORDINATOR (a fresh
    or restarted broker, a group it has not loaded yet) librdkafka dereferences the AdminClient's
    NULL group handle and the whole process dies with SIGSEGV (librdkafka issue #5040; seen here).
    """
    deadline = time.monotonic() + timeout_s

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    try:
        metadata = admin.list_topics(topic=topic, timeout=timeout_s)
        found = metadata.topics.get(topic)
        if found is None or found.error is not None:
            reason = found.error.name() if found is not None and found.error is not None else "missing"
            raise DepthUnavailable(f"kafka depth probe: topic {topic} is unavailable ({reason})")
        parts = [TopicPartition(topic, p) for p in sorted(found.partitions)]
        # Both watermark requests are in flight while the committed offsets are read.
        high = admin.list_offsets({tp: OffsetSpec.latest() for tp in parts}, request_timeout=remaining())
        low = admin.list_offsets({tp: OffsetSpec.earliest() for tp in parts}, request_timeout=remaining())
        committed = reader.committed(parts, timeout=remaining())
        highs = {tp.partition: future.result(timeout=remaining()).offset for tp, future in high.items()}
        lows = {tp.partition: future.result(timeout=remaining()).offset for tp, future in low.items()}
    except DepthUnavailable:
        raise
    except (KafkaException, TimeoutError) as exc:
        raise DepthUnavailable(f"kafka depth probe failed ({_describe(exc)})") from None
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


def offsets_reader(bootstrap_servers: str, group: str) -> Consumer:
    """A Consumer that only reads ``group``'s committed offsets: it never subscribes or commits."""
    return Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": group,
            "client.id": "agent-dispatch-offsets",
            "enable.auto.commit": False,
            "socket.nagle.disable": True,
            "logger": _ClientLog(),
            "error_cb": _ErrorReporter("offsets"),
        }
    )


# -- tuning ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KafkaTuning:
    """Knobs that are not deployment settings; tests and benchmarks shorten them."""

    #: How long one lag probe answers admission (100-250 ms keeps per-submit cost flat).
    probe_cache_s: float = 0.2
    #: Upper bound on one lag probe; past it admission rejects with DepthUnavailable.
    probe_timeout_s: float = 5.0
    #: librdkafka's message.timeout.ms: how long admit() may wait for the broker's acknowledgement.
    delivery_timeout_s: float = 30.0
    #: Acknowledgements are committed at most this often per consumer (always at claim and close).
    commit_interval_s: float = 0.05
    #: Claimed but neither acknowledged nor released for this long: redelivered (None: from settings).
    visibility_timeout_s: float | None = None
    #: Consumer group session timeout (a crashed process's partitions move after this); capped at
    #: the visibility timeout, since librdkafka needs it at or below max.poll.interval.ms.
    session_timeout_s: float = 45.0
    #: Upper bound on :meth:`KafkaTransport.close` (and on closing one consumer). librdkafka's own
    #: waits are unbounded or as long as the session timeout when the group coordinator is
    #: unavailable; past this, what is unconfirmed is abandoned (see ``close``).
    close_timeout_s: float = 5.0
    #: Producer linger. The flusher's flush() sends at once while it runs; linger only delays a
    #: message produced while the flusher is between rounds, so it can join the next request.
    linger_ms: float = 2.0
    producer_config: Mapping[str, Any] = field(default_factory=dict)
    consumer_config: Mapping[str, Any] = field(default_factory=dict)


class _ClientLog:
    """librdkafka logger: everything at DEBUG (see ``_client_log``)."""

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        if _client_log.isEnabledFor(logging.DEBUG):
            _client_log.debug(msg, *args)


class _ErrorReporter:
    """``error_cb``: one WARNING per error kind per minute, by name only (no addresses)."""

    def __init__(self, role: str) -> None:
        self._role = role
        self._last: dict[str, float] = {}

    def __call__(self, err: KafkaError) -> None:
        now = time.monotonic()
        name = err.name()
        if now - self._last.get(name, -1e9) >= 60.0:
            self._last[name] = now
            log.warning(
                "kafka %s client error", self._role, extra={"kafka_error": name, "fatal": err.fatal()}
            )


# -- producer: coalesced, delivery-confirmed -------------------------------------------------


class _Batch:
    """One admit() call's messages: wakes the caller once every message has a delivery report.

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


# -- consumers: one per worker thread ------------------------------------------------------------


class _SlotState(Enum):
    HELD = "held"  # handed out, waiting for ack/release
    DUE = "due"  # waiting to be redelivered at due_at


@dataclass(slots=True)
class _Slot:
    owner: str
    state: _SlotState
    deliveries: int
    deadline: float  # HELD: visibility deadline
    due_at: float = 0.0  # DUE: when it may be handed out again


#: Commit metadata version tag. The metadata tells the next owner of a partition what the previous
#: one delivered ("d": highest delivered offset) and which of those were still unacknowledged
#: ("u": offset ranges, "*" when too many to list), so acknowledged turns past the committed
#: prefix are not handed out again and redeliveries are counted.
_META_VERSION: Final = "ad1"
#: Brokers accept 4096 bytes of commit metadata by default; beyond this, "u=*" (redeliver all).
_META_MAX_CHARS: Final = 2000


@dataclass(frozen=True)
class _Prior:
    """What the previous owner of a partition recorded in its last commit."""

    delivered_through: int
    #: Offsets <= delivered_through still unacknowledged then (None: unknown, treat all as such).
    unacked: frozenset[int] | None

    @staticmethod
    def parse(text: str | None) -> _Prior | None:
        if not text or not text.startswith(_META_VERSION + ";"):
            return None
        fields = dict(item.partition("=")[::2] for item in text.split(";")[1:])
        try:
            through = int(fields["d"])
            listed = fields.get("u", "*")
            if listed == "*":
                return _Prior(through, None)
            offsets: set[int] = set()
            for span in filter(None, listed.split(",")):
                first, _, last = span.partition("-")
                offsets.update(range(int(first), int(last or first) + 1))
            return _Prior(through, frozenset(offsets))
        except (KeyError, ValueError):
            return None  # not ours or damaged: fall back to redelivering everything


def _ranges(offsets: Sequence[int]) -> str:
    """Sorted offsets as compact ranges: 3,5-7,9."""
    spans: list[str] = []
    start = prev = None
    for offset in offsets:
        if start is None:
            start = prev = offset
        elif prev is not None and offset == prev + 1:
            prev = offset
        else:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = offset
    if start is not None:
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(spans)


@dataclass
class _PartitionState:
    epoch: int
    #: Highest offset ever returned by the fetch stream in this assignment (None: nothing yet).
    max_seen: int | None = None
    #: Offset the fetch stream returns next (after a seek: the seek target).
    fetch_pos: int | None = None
    #: Delivered and not acknowledged, by offset: what the commit must not pass.
    unacked: dict[int, _Slot] = field(default_factory=dict)
    #: Delivered offsets in increasing order (fresh offsets only ever grow); acknowledged ones are
    #: dropped lazily from the left when the commit position is computed.
    order: collections.deque[int] = field(default_factory=collections.deque)
    #: Offsets in ``unacked`` waiting for redelivery.
    due: set[int] = field(default_factory=set)
    #: (offset, metadata) of the last commit sent for this partition.
    committed: tuple[int, str] | None = None
    prior_loaded: bool = False
    prior: _Prior | None = None
    seek_retry_at: float = 0.0

    def commit_position(self) -> int | None:
        """First offset not acknowledged: the contiguous acknowledged prefix ends just before it."""
        order, unacked = self.order, self.unacked
        while order and order[0] not in unacked:
            order.popleft()
        if order:
            return order[0]
        return None if self.max_seen is None else self.max_seen + 1

    def commit_metadata(self) -> str:
        if self.max_seen is None:
            return ""
        text = f"{_META_VERSION};d={self.max_seen};u={_ranges(sorted(self.unacked))}"
        return text if len(text) <= _META_MAX_CHARS else f"{_META_VERSION};d={self.max_seen};u=*"


@dataclass(frozen=True)
class _Token:
    consumer: str
    partition: int
    offset: int
    epoch: int
    delivery: int

    def encode(self) -> str:
        return (
            f"{_RECEIPT_VERSION}:{self.consumer}:{self.partition}:{self.offset}:{self.epoch}:{self.delivery}"
        )

    @staticmethod
    def decode(token: str) -> _Token:
        parts = token.split(":")
        if len(parts) != 6 or parts[0] != _RECEIPT_VERSION:
            raise Fenced("not a Kafka transport receipt")
        try:
            return _Token(parts[1], int(parts[2]), int(parts[3]), int(parts[4]), int(parts[5]))
        except ValueError:
            raise Fenced("malformed Kafka transport receipt") from None


#: How long a claim may run past its wait while skipping already acknowledged records.
_SKIP_GRACE_S: Final = 5.0

_consumer_ids = itertools.count(1)
_epochs = itertools.count(1)

#: Consumer errors that no retry fixes: the configuration is refused by the cluster.
_CONFIG_ERRORS: Final = frozenset(
    {
        KafkaError.INVALID_SESSION_TIMEOUT,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
    }
)


class _ThreadConsumer:
    """One worker thread's consumer and its per-partition delivery state.

    The owning thread does everything except (a) the background committer flushing a coalesced
    commit while the owner is not inside a call and (b) closing at shutdown or after the owner
    thread died. The lock keeps those from interleaving with the owner; rebalance callbacks run
    inside the lock holder's own ``poll``/``consume``/``close`` call.
    """

    def __init__(self, transport: KafkaTransport) -> None:
        self.uid = f"{threading.get_ident():x}.{next(_consumer_ids)}"
        self.thread = threading.current_thread()
        self.lock = threading.Lock()
        self.closed = False
        #: Acknowledgements (or deliveries) not committed yet; the committer flushes them.
        self.dirty = False
        self._t = transport
        self._topic = transport.topic
        self._visibility_s = transport.visibility_timeout_s
        self._commit_interval_s = transport.tuning.commit_interval_s
        self._parts: dict[int, _PartitionState] = {}
        self._next_expiry = float("inf")
        self._last_commit = 0.0
        visibility_ms = max(1000, int(self._visibility_s * 1000))
        # librdkafka requires session.timeout <= max.poll.interval; see max.poll.interval below.
        session_ms = min(int(transport.tuning.session_timeout_s * 1000), visibility_ms)
        config: dict[str, Any] = {
            "bootstrap.servers": transport.bootstrap_servers,
            "group.id": transport.group,
            "client.id": f"agent-dispatch-worker-{self.uid}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            # Incremental rebalancing: a worker thread joining or leaving moves only the partitions
            # that must move, instead of revoking (and redelivering) every partition of the group.
            "partition.assignment.strategy": "cooperative-sticky",
            "session.timeout.ms": session_ms,
            # Members learn of a rebalance from their heartbeat, and a cooperative rebalance takes
            # two rounds: a short interval lets a joining worker thread get partitions in ~2 s.
            "heartbeat.interval.ms": max(100, min(1000, session_ms // 3)),
            # The visibility timeout, enforced by the group: a thread that has not come back to
            # claim (or ack) for this long is taken out of the group, so its partitions, and the
            # deliveries it withheld, go to another consumer from the committed prefix.
            "max.poll.interval.ms": visibility_ms,
            # Partitions added by the operator are picked up within this interval.
            "topic.metadata.refresh.interval.ms": 30_000,
            "socket.nagle.disable": True,
            "logger": _ClientLog(),
            "error_cb": _ErrorReporter("consumer"),
            "on_commit": self._on_commit,
            **transport.tuning.consumer_config,
        }
        self.consumer = Consumer(config)
        self.consumer.subscribe(
            [self._topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )

    # -- rebalance callbacks (inside the lock holder's poll/consume/close) -----------------------

    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            if tp.topic == self._topic:
                # A fresh epoch: receipts issued under an earlier assignment of this partition
                # (before a revoke) can never acknowledge anything in this one.
                self._parts[tp.partition] = _PartitionState(epoch=next(_epochs))

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Hand over exactly the acknowledged prefix (and what lies past it), so the next owner
        # starts at the first unacknowledged turn; what this thread still holds becomes stale.
        # Inside close() the prefix was already sent (asynchronously, awaited by librdkafka's
        # close): a synchronous commit here would wait up to the session timeout for an
        # unavailable coordinator, past any shutdown grace.
        revoked = {tp.partition for tp in partitions if tp.topic == self._topic}
        if not self.closed:
            self.commit(synchronous=True, only=revoked)
        for partition in revoked:
            self._parts.pop(partition, None)

    def _on_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The group already gave these away: a commit now would be refused (stale generation).
        for tp in partitions:
            if tp.topic == self._topic:
                self._parts.pop(tp.partition, None)

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """Results of asynchronous commits (served inside this consumer's own calls).

        A failed commit (broker restarting, coordinator moving) is forgotten, so the next commit
        sends that position again. Otherwise ``committed`` would claim the broker has it, and an
        idle partition would keep its acknowledged deliveries counted in the lag for ever.
        """
        for tp in partitions or []:
            if err is None and tp.error is None:
                continue
            state = self._parts.get(tp.partition) if tp.topic == self._topic else None
            if state is not None and state.committed is not None and state.committed[0] == tp.offset:
                state.committed = None

    # -- claim ---------------------------------------------------------------------------------

    def claim(self, owner: str, max_items: int, wait_s: float) -> list[Delivery]:
        deadline = time.monotonic() + max(0.0, wait_s)
        out: list[Delivery] = []
        self.commit(force=True)
        while True:
            now = time.monotonic()
            self._expire(now)
            wake_at = self._seek_due(now)
            if out:
                batch = self.consumer.consume(max_items - len(out), timeout=0)
            else:
                # Wake up for the earliest pending redelivery, and at least every 250 ms so
                # visibility expiry keeps moving during a long wait.
                first = self.consumer.poll(max(0.0, min(deadline, wake_at, now + 0.25) - now))
                batch = [] if first is None else [first]
                if first is not None and max_items > 1:
                    batch.extend(self.consumer.consume(max_items - 1, timeout=0))
            now = time.monotonic()
            records = 0  # error events (broker down, ...) are not records: they never extend a claim
            for message in batch:
                if message.error() is None:
                    records += 1
                delivery = self._accept(message, owner, now)
                if delivery is not None:
                    out.append(delivery)
            if len(out) >= max_items or (out and not records):
                break
            # Past the deadline, keep reading only while records stream in that are all skipped
            # (acknowledged ones after a seek back); the hard stop bounds even that.
            if now >= deadline and (out or not records or now >= deadline + _SKIP_GRACE_S):
                break
        if out:
            # Record what was handed out (commit metadata), so a next owner counts redeliveries.
            self.commit()
        return out

    def _accept(self, message: Message, owner: str, now: float) -> Delivery | None:
        err = message.error()
        if err is not None:
            if err.fatal() or err.code() in _CONFIG_ERRORS:
                raise BackendUnavailable(f"kafka consumer cannot continue ({err.name()})")
            if err.code() != KafkaError._PARTITION_EOF:
                log.debug("kafka consumer event", extra={"kafka_error": err.name()})
            return None
        partition, offset = message.partition(), message.offset()
        if partition is None or offset is None or message.topic() != self._topic:
            return None
        state = self._parts.get(partition)
        if state is None:
            return None  # fetched before a revoke; the new owner delivers it
        state.fetch_pos = offset + 1
        if state.max_seen is not None and offset <= state.max_seen:
            # Seen before in this assignment: acknowledged, still held, or released. Only a
            # released (or expired) delivery whose time has come is handed out again.
            slot = state.unacked.get(offset)
            if slot is None or slot.state is not _SlotState.DUE or slot.due_at > now:
                return None
            state.due.discard(offset)
            slot.state, slot.owner, slot.deliveries = _SlotState.HELD, owner, slot.deliveries + 1
            slot.deadline = now + self._visibility_s
        else:
            state.max_seen = offset
            prior = self._prior(partition, state)
            before = 0
            if prior is not None and offset <= prior.delivered_through:
                if prior.unacked is not None and offset not in prior.unacked:
                    return None  # the previous owner had it acknowledged past its committed prefix
                before = 1
            slot = _Slot(
                owner=owner, state=_SlotState.HELD, deliveries=before + 1, deadline=now + self._visibility_s
            )
            state.unacked[offset] = slot
            state.order.append(offset)
        self._next_expiry = min(self._next_expiry, slot.deadline)
        token = _Token(self.uid, partition, offset, state.epoch, slot.deliveries)
        return Delivery(
            wire=message.value() or b"",
            receipt=Receipt(owner=owner, token=token.encode()),
            work_item_id=_work_item_id(message),
            redelivered=slot.deliveries - 1,
        )

    def _prior(self, partition: int, state: _PartitionState) -> _Prior | None:
        """The previous owner's commit metadata for a newly assigned partition (read once)."""
        if not state.prior_loaded:
            state.prior_loaded = True
            try:
                (found,) = self.consumer.committed([TopicPartition(self._topic, partition)], timeout=5.0)
                state.prior = _Prior.parse(found.metadata)
            except (KafkaException, ValueError) as exc:
                # Without it every turn past the prefix is simply delivered again.
                log.debug("kafka committed metadata unavailable", extra={"kafka_error": _describe(exc)})
        return state.prior

    def _expire(self, now: float) -> None:
        """Held past the visibility timeout: due for redelivery now (the old receipt is stale)."""
        if now < self._next_expiry:
            return
        nearest = float("inf")
        for state in self._parts.values():
            for offset, slot in state.unacked.items():
                if slot.state is _SlotState.HELD:
                    if slot.deadline <= now:
                        slot.state, slot.due_at = _SlotState.DUE, now
                        state.due.add(offset)
                    else:
                        nearest = min(nearest, slot.deadline)
        self._next_expiry = nearest

    def _seek_due(self, now: float) -> float:
        """Seek each partition back to its lowest due delivery; returns the next due time."""
        wake_at = float("inf")
        for partition, state in self._parts.items():
            if not state.due:
                continue
            ready = [o for o in state.due if state.unacked[o].due_at <= now]
            later = [state.unacked[o].due_at for o in state.due if state.unacked[o].due_at > now]
            if later:
                wake_at = min(wake_at, *later)
            if not ready:
                continue
            target = min(ready)
            if state.fetch_pos is not None and target >= state.fetch_pos:
                continue  # the stream reaches it by itself
            if now < state.seek_retry_at:
                wake_at = min(wake_at, state.seek_retry_at)
                continue
            try:
                self.consumer.seek(TopicPartition(self._topic, partition, target))
            except KafkaException as exc:
                # E.g. the partition is still being started after an assignment: retry shortly.
                state.seek_retry_at = now + 0.1
                wake_at = min(wake_at, state.seek_retry_at)
                log.debug("kafka seek deferred", extra={"kafka_error": _describe(exc)})
                continue
            state.fetch_pos = target
        return wake_at

    # -- ack / release ---------------------------------------------------------------------------

    def _slot_for(self, token: _Token, owner: str) -> tuple[_PartitionState, _Slot]:
        state = self._parts.get(token.partition)
        if state is None or state.epoch != token.epoch:
            raise Fenced("the partition of this delivery was reassigned; it will be redelivered")
        slot = state.unacked.get(token.offset)
        if slot is None or slot.deliveries != token.delivery or slot.state is not _SlotState.HELD:
            raise Fenced("this delivery was already acknowledged, released or handed out again")
        if slot.owner != owner:
            raise Fenced("the receipt names another owner")
        now = time.monotonic()
        if now >= slot.deadline:
            slot.state, slot.due_at = _SlotState.DUE, now
            state.due.add(token.offset)
            raise Fenced("the visibility timeout passed; the delivery will be redelivered")
        return state, slot

    def ack(self, token: _Token, owner: str) -> None:
        state, _slot = self._slot_for(token, owner)
        del state.unacked[token.offset]
        self.commit()

    def release(self, token: _Token, owner: str, delay_s: float) -> None:
        state, slot = self._slot_for(token, owner)
        slot.state, slot.due_at = _SlotState.DUE, time.monotonic() + max(0.0, delay_s)
        state.due.add(token.offset)

    # -- commits ---------------------------------------------------------------------------------

    def commit(
        self,
        *,
        force: bool = False,
        synchronous: bool = False,
        resend: bool = False,
        only: set[int] | None = None,
    ) -> None:
        """Commit each partition's acknowledged prefix (with metadata), at most once per interval.

        Within the interval the commit is left to the background committer (or the next claim),
        so a burst of acknowledgements costs one request, and an idle owner's last ones still land.
        ``resend`` (and ``synchronous``) sends every position even if an earlier asynchronous
        commit already carried it, since that one may have failed unnoticed.
        """
        now = time.monotonic()
        if not force and not synchronous and now - self._last_commit < self._commit_interval_s:
            if not self.dirty:
                self.dirty = True
                self._t._commit_soon()
            return
        self.dirty = False
        offsets = []
        for partition, state in self._parts.items():
            if only is not None and partition not in only:
                continue
            position = state.commit_position()
            if position is None:
                continue
            metadata = state.commit_metadata()
            # On revoke and close: even if an asynchronous commit already carried it, confirm it.
            if synchronous or resend or state.committed != (position, metadata):
                offsets.append(TopicPartition(self._topic, partition, position, metadata))
                state.committed = (position, metadata)
        if not offsets:
            return
        self._last_commit = now
        try:
            if synchronous:
                self.consumer.commit(offsets=offsets, asynchronous=False)
            else:
                self.consumer.commit(offsets=offsets, asynchronous=True)
        except KafkaException as exc:
            # Not lost: a later commit carries it, or the next owner redelivers a little more.
            for tp in offsets:
                failed = self._parts.get(tp.partition)
                if failed is not None:
                    failed.committed = None
            log.warning("kafka offset commit failed", extra={"kafka_error": _describe(exc)})

    def close(self, timeout_s: float) -> bool:
        """Stop serving, send the acknowledged prefix and leave the group, within ``timeout_s``.

        Callable from any thread that does not hold ``lock``. Returns True when librdkafka's close
        finished in time. Its waits are not bounded by anything we can pass: a synchronous commit
        waits up to the session timeout for an unavailable group coordinator, and the close itself
        waits for outstanding commits and the group leave. So the commit is sent asynchronously
        (the close waits for it while the coordinator answers) and the close runs on a helper
        thread that is abandoned at the deadline. Nothing is lost then: an unconfirmed commit
        means the next owner redelivers acknowledged turns (skipped against their settled
        WorkItems), and a member that did not leave is removed after its session timeout.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not self.lock.acquire(timeout=max(0.0, timeout_s)):
            return False  # the owner is inside a call that does not return: the group times it out
        try:
            if self.closed:
                return True
            self.closed = True  # from here no other thread calls into the consumer
            self.commit(force=True, resend=True)
        finally:
            self.lock.release()
        closer = threading.Thread(target=self._close_client, name=f"kafka-close-{self.uid}", daemon=True)
        closer.start()
        closer.join(max(0.0, deadline - time.monotonic()))
        return not closer.is_alive()

    def _close_client(self) -> None:
        try:
            # Leaves the group at once (the partitions move now, not after a session timeout).
            self.consumer.close()
        except (KafkaException, RuntimeError) as exc:
            log.warning("kafka consumer close failed", extra={"kafka_error": _describe(exc)})
        self._parts.clear()


def _work_item_id(message: Message) -> str:
    for key, value in message.headers() or []:
        if key == WORK_ITEM_HEADER and value is not None:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return ""


class _Committer:
    """Background thread: flushes coalesced commits of idle consumers, closes orphaned ones.

    A consumer whose owner thread is inside a call is skipped (non-blocking lock): that call
    commits by itself. A consumer whose owner thread has exited is closed, so its partitions move
    to live consumers now rather than after the visibility timeout.
    """

    def __init__(self, transport: KafkaTransport) -> None:
        self._t = transport
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kafka-committer", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        interval = max(0.005, self._t.tuning.commit_interval_s)
        while not self._stopping:
            self._wake.wait(1.0)
            self._wake.clear()
            if self._stopping:
                return
            time.sleep(interval)  # let the acknowledgements of a burst pile into one commit
            retry = False
            for tc in self._t._consumer_list():
                try:
                    if not tc.thread.is_alive():
                        self._t._forget(tc)
                        if not tc.close(self._t.tuning.close_timeout_s):
                            log.warning("kafka consumer of an exited thread did not close in time")
                    elif tc.dirty:
                        if not tc.lock.acquire(blocking=False):
                            retry = True  # the owner is in a call; look again after the interval
                            continue
                        try:
                            if not tc.closed:
                                tc.commit(force=True)
                        finally:
                            tc.lock.release()
                except Exception:  # keep flushing the others
                    log.exception("kafka background commit failed")
            if retry:
                self._wake.set()

    def stop(self, timeout_s: float) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)


# -- the transport -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Probe:
    started: float
    #: Delivery reports served before the probe began (the baseline for in-flight admissions).
    reported: int
    lag: int | None
    error: str | None = None


class Reservation:
    """Room under the depth bound held for turns not produced yet (:meth:`KafkaTransport.reserve`).

    Counted as queued until it is admitted or released, so concurrent admissions cannot take it.
    Release what is not used (``release()`` or the ``with`` block); admitting more than the room
    left is a programming error.
    """

    def __init__(self, transport: KafkaTransport, count: int) -> None:
        self._t = transport
        self._lock = threading.Lock()
        self._remaining = count

    @property
    def remaining(self) -> int:
        return self._remaining

    def admit(self, turns: Sequence[OutboundTurn]) -> None:
        """Produce ``turns`` in the reserved room: as :meth:`KafkaTransport.admit`, without the bound check."""
        if not turns:
            return
        with self._lock:
            if len(turns) > self._remaining:
                raise ValueError(f"{len(turns)} turns exceed the {self._remaining} reserved")
            self._remaining -= len(turns)
        self._t._produce(turns)

    def release(self) -> None:
        """Give back the room not admitted (idempotent)."""
        with self._lock:
            unused, self._remaining = self._remaining, 0
        self._t._release_reserved(unused)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class KafkaTransport:
    """:class:`agent_dispatch.transport.Transport` on Kafka (see the module docstring)."""

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
        self._admin = AdminClient(
            {
                "bootstrap.servers": self.bootstrap_servers,
                "client.id": "agent-dispatch-admin",
                "socket.nagle.disable": True,
                "logger": _ClientLog(),
                "error_cb": _ErrorReporter("admin"),
            }
        )
        self._lock = threading.Lock()
        self._closed = False
        self._producer: Producer | None = None
        self._flusher: _Flusher | None = None
        self._local = threading.local()
        self._consumers: dict[str, _ThreadConsumer] = {}
        self._committer: _Committer | None = None
        # Admission bookkeeping (see _reserve_bounded).
        self._probe_lock = threading.Lock()
        self._probe: _Probe | None = None
        self._admit_lock = threading.Lock()
        self._reserved = 0
        self._failed_locally = 0
        self._reader: Consumer | None = None

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
                with self._probe_lock:
                    consumer_group_lag(
                        self._admin,
                        self.topic,
                        self.group,
                        timeout_s=self.tuning.probe_timeout_s,
                        reader=self._offsets_reader(),
                    )
                return
            except DepthUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise BackendUnavailable(f"kafka: topic {self.topic} is not usable ({exc})") from None
                time.sleep(0.1)

    def close(self) -> None:
        """Commit and close every consumer, flush the producer (call after workers stop).

        Returns within ``tuning.close_timeout_s`` whatever the cluster does (a worker must exit
        within its shutdown grace even while the broker or the group coordinator is down): the
        consumers close in parallel, each abandoned at the deadline (see ``_ThreadConsumer.close``),
        and the producer's flush gets what is left. An undelivered message is the caller's
        ``DeliveryFailed`` (its WorkItem stays ready for the recovery sweep) or a re-drive the
        sweep repeats.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            consumers = list(self._consumers.values())
            self._consumers.clear()
        deadline = time.monotonic() + self.tuning.close_timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        if self._committer is not None:
            # Between rounds it stops at once; closing an exited thread's consumer, it keeps its
            # own bound and needs no waiting for (that consumer is no longer in the list).
            self._committer.stop(timeout_s=min(left(), 1.0))
        closers = [
            threading.Thread(target=self._close_consumer_within, args=(tc, left()), daemon=True)
            for tc in consumers
        ]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(left())
        if self._flusher is not None:
            self._flusher.stop(timeout_s=min(left(), 1.0))
        if self._producer is not None:
            remaining = self._producer.flush(left())
            if remaining:
                log.warning("kafka producer closed with undelivered messages", extra={"count": remaining})
        reader = None
        if self._probe_lock.acquire(timeout=left()):
            try:
                reader, self._reader = self._reader, None
            finally:
                self._probe_lock.release()
        if reader is not None:
            closing = threading.Thread(target=reader.close, name="kafka-close-offsets", daemon=True)
            closing.start()
            closing.join(left())

    @staticmethod
    def _close_consumer_within(tc: _ThreadConsumer, timeout_s: float) -> None:
        if not tc.close(timeout_s):
            log.warning(
                "kafka consumer did not close in time; the group removes it after its session timeout",
                extra={"timeout_s": round(timeout_s, 1)},
            )

    def close_consumer(self) -> None:
        """Close the calling thread's consumer (a worker thread that exits calls this)."""
        tc: _ThreadConsumer | None = getattr(self._local, "consumer", None)
        if tc is None:
            return
        self._local.consumer = None
        with self._lock:
            self._consumers.pop(tc.uid, None)
        tc.close(self.tuning.close_timeout_s)

    # -- admission -------------------------------------------------------------------------------

    def admit(self, turns: Sequence[OutboundTurn], *, bounded: bool = True) -> None:
        """Returns once the broker acknowledged every turn (``acks=all``), or raises.

        ``QueueFull``/``DepthUnavailable`` before anything is sent; :class:`DeliveryFailed` when
        the broker did not confirm every turn (some may have been written: Kafka has no
        all-or-nothing produce without transactions). ``bounded=False`` skips the bound; Kafka
        cannot see whether a turn still has a queued delivery, so a re-drive may produce a second
        one, which the WorkItem lease turns into a no-op.
        """
        if not turns:
            return
        self._producing()  # a closed transport refuses before anything is reserved
        count = len(turns)
        if bounded:
            self._reserve_bounded(count)
        else:
            with self._admit_lock:
                self._reserved += count
        self._produce(turns)

    def reserve(self, count: int, *, partial: bool = False) -> Reservation:
        """Room under the bound for ``count`` turns, held until admitted or released.

        The enqueue path reserves before it stores a WorkItem, so a full queue (``QueueFull``) or
        an unknown depth (``DepthUnavailable``) refuses a turn before anything exists under its
        idempotency key; the turns are then produced with :meth:`Reservation.admit`, which does
        not check the bound again. ``partial``: grant as much of ``count`` as there is room for
        (at least one, else ``QueueFull``); :attr:`Reservation.remaining` says how much.
        """
        if count < 1:
            raise ValueError("count must be at least 1")
        self._producing()
        return Reservation(self, self._reserve_bounded(count, partial=partial))

    def _release_reserved(self, count: int) -> None:
        """Reserved turns that will never be produced: settled like ones that never reached librdkafka."""
        if count > 0:
            with self._admit_lock:
                self._failed_locally += count

    def _produce(self, turns: Sequence[OutboundTurn]) -> None:
        """Produce turns whose room is already reserved; returns once the broker confirmed every one."""
        count = len(turns)
        try:
            producer, flusher = self._producing()
        except BaseException:
            self._release_reserved(count)
            raise
        batch = _Batch(count, flusher)
        on_delivery, produce, topic = batch.on_delivery, producer.produce, self.topic
        produced = 0
        try:
            for turn in turns:
                key, header = turn.session_id.encode(), [(WORK_ITEM_HEADER, turn.work_item_id.encode())]
                try:
                    produce(topic, turn.wire, key, headers=header, on_delivery=on_delivery)
                except BufferError:
                    self._produce_when_room(producer, turn.wire, key, header, on_delivery)
                produced += 1
        except KafkaException as exc:
            raise DeliveryFailed(f"kafka refused the turn ({_describe(exc)})") from None
        finally:
            if produced < count:
                # Never reached librdkafka: settle them here so the bookkeeping stays exact.
                with self._admit_lock:
                    self._failed_locally += count - produced
                for _ in range(count - produced):
                    batch.settle("not enqueued")
            flusher.kick()
        if not batch.done.acquire(timeout=self.tuning.delivery_timeout_s + 10.0):
            raise DeliveryFailed(f"kafka did not confirm {batch.remaining} of {count} turns in time")
        if batch.errors:
            raise DeliveryFailed(
                f"kafka did not accept {len(batch.errors)} of {count} turns ({sorted(set(batch.errors))[0]})"
            )

    def _produce_when_room(
        self, producer: Producer, value: bytes, key: bytes, headers: list[tuple[str, bytes]], on_delivery: Any
    ) -> None:
        """librdkafka's local queue is full: the flusher is draining it; retry until the deadline."""
        deadline = time.monotonic() + self.tuning.delivery_timeout_s
        while True:
            self._flusher_kick()
            time.sleep(0.002)
            try:
                producer.produce(self.topic, value, key, headers=headers, on_delivery=on_delivery)
                return
            except BufferError:
                if time.monotonic() > deadline:
                    raise DeliveryFailed("kafka producer queue stayed full") from None

    def _flusher_kick(self) -> None:
        if self._flusher is not None:
            self._flusher.kick()

    def _reserve_bounded(self, count: int, *, partial: bool = False) -> int:
        """Check depth + count against the bound and reserve the room (returns how much), or raise.

        The estimate is the probed lag plus every turn this process reserved that had not been
        confirmed when the probe began: those may or may not be in the probed watermarks, so they
        are counted (over-counting only ever rejects, never over-admits). ``partial``: reserve
        what fits of ``count`` (at least one).
        """
        probe = self._fresh_probe(time.monotonic())
        if probe.lag is None:
            raise DepthUnavailable(probe.error or "kafka depth probe failed")
        with self._admit_lock:
            in_flight = self._reserved - probe.reported
            depth = probe.lag + max(0, in_flight)
            granted = min(count, self.max_depth - depth) if partial else count
            if granted < 1 or depth + granted > self.max_depth:
                raise QueueFull(f"queue depth {depth} + {count} exceeds {self.max_depth}")
            self._reserved += granted
            return granted

    def _reports(self) -> int:
        flusher = self._flusher
        return (0 if flusher is None else flusher.reported) + self._failed_locally

    def _fresh_probe(self, arrival: float) -> _Probe:
        """A lag probe that began no more than ``probe_cache_s`` before ``arrival``.

        Single flight: callers that arrive while a probe runs wait for it and share its answer
        (a failure too: during an outage, N callers wait one timeout, not N timeouts in a row).
        """
        ttl = self.tuning.probe_cache_s
        probe = self._probe
        if probe is not None and arrival - probe.started <= ttl:
            return probe
        with self._probe_lock:
            probe = self._probe
            if probe is not None and arrival - probe.started <= ttl:
                return probe
            started = time.monotonic()
            reported = self._reports()
            try:
                lag = consumer_group_lag(
                    self._admin,
                    self.topic,
                    self.group,
                    timeout_s=self.tuning.probe_timeout_s,
                    reader=self._offsets_reader(),
                )
                probe = _Probe(started, reported, lag)
            except DepthUnavailable as exc:
                probe = _Probe(started, reported, None, str(exc))
            self._probe = probe
            return probe

    def _offsets_reader(self) -> Consumer:
        """The depth probe's committed-offsets reader (callers hold ``_probe_lock``)."""
        if self._reader is None:
            self._reader = offsets_reader(self.bootstrap_servers, self.group)
        return self._reader

    def depth(self) -> int:
        probe = self._fresh_probe(time.monotonic())
        if probe.lag is None:
            raise DepthUnavailable(probe.error or "kafka depth probe failed")
        with self._admit_lock:
            return probe.lag + max(0, self._reserved - probe.reported)

    def _producing(self) -> tuple[Producer, _Flusher]:
        producer, flusher = self._producer, self._flusher
        if producer is not None and flusher is not None and not self._closed:
            return producer, flusher
        with self._lock:
            if self._closed:
                raise BackendUnavailable("kafka transport is closed")
            if self._producer is None or self._flusher is None:
                config: dict[str, Any] = {
                    "bootstrap.servers": self.bootstrap_servers,
                    "client.id": "agent-dispatch-producer",
                    # Exactly-once per partition on retries, in order; acks=all is implied, but said.
                    "enable.idempotence": True,
                    "acks": "all",
                    "linger.ms": self.tuning.linger_ms,
                    "message.timeout.ms": int(self.tuning.delivery_timeout_s * 1000),
                    # Same key -> same partition as Java clients (murmur2), so sessions stay put
                    # whichever client produced them.
                    "partitioner": "murmur2_random",
                    "queue.buffering.max.messages": 1_000_000,
                    "topic.metadata.refresh.interval.ms": 30_000,
                    "socket.nagle.disable": True,
                    "logger": _ClientLog(),
                    "error_cb": _ErrorReporter("producer"),
                    **self.tuning.producer_config,
                }
                self._producer = Producer(config)
                self._flusher = _Flusher(self._producer)
            return self._producer, self._flusher

    # -- consuming -------------------------------------------------------------------------------

    def _consumer_for_thread(self) -> _ThreadConsumer:
        tc: _ThreadConsumer | None = getattr(self._local, "consumer", None)
        if tc is None:
            with self._lock:
                if self._closed:
                    raise BackendUnavailable("kafka transport is closed")
                tc = _ThreadConsumer(self)
                self._consumers[tc.uid] = tc
                if self._committer is None:
                    self._committer = _Committer(self)
            self._local.consumer = tc
        return tc

    def _consumer_list(self) -> list[_ThreadConsumer]:
        with self._lock:
            return list(self._consumers.values())

    def _forget(self, tc: _ThreadConsumer) -> None:
        with self._lock:
            self._consumers.pop(tc.uid, None)

    def _commit_soon(self) -> None:
        committer = self._committer
        if committer is not None:
            committer.kick()

    def claim(self, owner: str, *, max_items: int = 1, wait_s: float = 0.0) -> list[Delivery]:
        if max_items < 1:
            return []
        tc = self._consumer_for_thread()
        with tc.lock:
            if tc.closed:
                raise BackendUnavailable("kafka transport is closed")
            return tc.claim(owner, max_items, wait_s)

    def _own(self, receipt: Receipt) -> tuple[_ThreadConsumer, _Token]:
        token = _Token.decode(receipt.token)
        tc: _ThreadConsumer | None = getattr(self._local, "consumer", None)
        if tc is None or tc.uid != token.consumer:
            raise Fenced("the receipt belongs to another worker thread's consumer")
        return tc, token

    def ack(self, receipt: Receipt) -> None:
        tc, token = self._own(receipt)
        with tc.lock:
            if tc.closed:
                raise Fenced("the consumer that issued this receipt is closed")
            tc.ack(token, receipt.owner)

    def release(self, receipt: Receipt, *, delay_s: float = 0.0) -> None:
        tc, token = self._own(receipt)
        with tc.lock:
            if tc.closed:
                raise Fenced("the consumer that issued this receipt is closed")
            tc.release(token, receipt.owner, delay_s)


__all__ = [
    "WORK_ITEM_HEADER",
    "DeliveryFailed",
    "KafkaTransport",
    "KafkaTuning",
    "PartitionDecreaseRefused",
    "Reservation",
    "TopicChange",
    "consumer_group_lag",
    "ensure_topic",
    "offsets_reader",
    "topic_partition_count",
]
