"""One worker thread's consumer: claims, acknowledgements, releases, redelivery and commits.

Manual commits only, and only up to each partition's contiguous acknowledged prefix. A receipt
names the claiming owner and the consumer, and the assignment it was issued under; a revoked
partition or an expired visibility window gets :class:`Fenced`. A released delivery, or one
held past the visibility timeout, is redelivered by seeking the partition back to it once it is
due; offsets acknowledged in between are skipped on the way forward. The visibility timeout is
also the consumer's ``max.poll.interval.ms``: a thread that stops coming back is taken out of
the group, and its partitions restart on another consumer from the committed prefix, so nothing
unacknowledged is ever skipped. Each commit's metadata records what was delivered past the
prefix and which of those were still unacknowledged, so that next owner skips the acknowledged
ones and counts redeliveries.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from agent_dispatch.errors import BackendUnavailable, Fenced
from agent_dispatch.transport import Delivery, Receipt
from agent_dispatch.transports.kafka._bookkeeping import PartitionState, Prior, Slot, SlotState, Token
from agent_dispatch.transports.kafka._client import client_config, describe
from agent_dispatch.transports.kafka._config import WORK_ITEM_HEADER, KafkaTuning

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsumerSpec:
    """What every worker thread's consumer is made from."""

    bootstrap_servers: str
    group: str
    topic: str
    visibility_timeout_s: float
    tuning: KafkaTuning


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


class ThreadConsumer:
    """One worker thread's consumer and its per-partition delivery state.

    The owning thread does everything except (a) the background committer flushing a coalesced
    commit while the owner is not inside a call and (b) closing at shutdown or after the owner
    thread died. The lock keeps those from interleaving with the owner; rebalance callbacks run
    inside the lock holder's own ``poll``/``consume``/``close`` call.
    """

    def __init__(self, spec: ConsumerSpec, on_dirty: Callable[[], None]) -> None:
        """``on_dirty`` is called when acknowledgements wait for the background committer."""
        self.uid = f"{threading.get_ident():x}.{next(_consumer_ids)}"
        self.thread = threading.current_thread()
        self.lock = threading.Lock()
        self.closed = False
        #: Acknowledgements (or deliveries) not committed yet; the committer flushes them.
        self.dirty = False
        self._on_dirty = on_dirty
        self._topic = spec.topic
        self._visibility_s = spec.visibility_timeout_s
        self._commit_interval_s = spec.tuning.commit_interval_s
        self._commit_refresh_s = spec.tuning.commit_refresh_s
        self._parts: dict[int, PartitionState] = {}
        self._next_expiry = float("inf")
        self._last_commit = 0.0
        visibility_ms = max(1000, int(self._visibility_s * 1000))
        # librdkafka requires session.timeout <= max.poll.interval; see max.poll.interval below.
        session_ms = min(int(spec.tuning.session_timeout_s * 1000), visibility_ms)
        config: dict[str, Any] = {
            **client_config(spec.bootstrap_servers, f"agent-dispatch-worker-{self.uid}", "consumer"),
            "group.id": spec.group,
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
            "on_commit": self._on_commit,
            **spec.tuning.consumer_config,
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
                self._parts[tp.partition] = PartitionState(epoch=next(_epochs))

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
            if slot is None or slot.state is not SlotState.DUE or slot.due_at > now:
                return None
            state.due.discard(offset)
            slot.state, slot.owner, slot.deliveries = SlotState.HELD, owner, slot.deliveries + 1
            slot.deadline = now + self._visibility_s
        else:
            state.max_seen = offset
            prior = self._prior(partition, state)
            before = 0
            if prior is not None and offset <= prior.delivered_through:
                if prior.unacked is not None and offset not in prior.unacked:
                    return None  # the previous owner had it acknowledged past its committed prefix
                before = 1
            slot = Slot(
                owner=owner, state=SlotState.HELD, deliveries=before + 1, deadline=now + self._visibility_s
            )
            state.unacked[offset] = slot
            state.order.append(offset)
        self._next_expiry = min(self._next_expiry, slot.deadline)
        token = Token(self.uid, partition, offset, state.epoch, slot.deliveries)
        return Delivery(
            wire=message.value() or b"",
            receipt=Receipt(owner=owner, token=token.encode()),
            work_item_id=work_item_id(message),
            redelivered=slot.deliveries - 1,
        )

    def _prior(self, partition: int, state: PartitionState) -> Prior | None:
        """The previous owner's commit metadata for a newly assigned partition (read once)."""
        if not state.prior_loaded:
            state.prior_loaded = True
            try:
                (found,) = self.consumer.committed([TopicPartition(self._topic, partition)], timeout=5.0)
                state.prior = Prior.parse(found.metadata)
            except (KafkaException, ValueError) as exc:
                # Without it every turn past the prefix is simply delivered again.
                log.debug("kafka committed metadata unavailable", extra={"kafka_error": describe(exc)})
        return state.prior

    def _expire(self, now: float) -> None:
        """Held past the visibility timeout: due for redelivery now (the old receipt is stale)."""
        if now < self._next_expiry:
            return
        nearest = float("inf")
        for state in self._parts.values():
            for offset, slot in state.unacked.items():
                if slot.state is SlotState.HELD:
                    if slot.deadline <= now:
                        slot.state, slot.due_at = SlotState.DUE, now
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
                log.debug("kafka seek deferred", extra={"kafka_error": describe(exc)})
                continue
            state.fetch_pos = target
        return wake_at

    # -- ack / release ---------------------------------------------------------------------------

    def _slot_for(self, token: Token, owner: str) -> tuple[PartitionState, Slot]:
        state = self._parts.get(token.partition)
        if state is None or state.epoch != token.epoch:
            raise Fenced("the partition of this delivery was reassigned; it will be redelivered")
        slot = state.unacked.get(token.offset)
        if slot is None or slot.deliveries != token.delivery or slot.state is not SlotState.HELD:
            raise Fenced("this delivery was already acknowledged, released or handed out again")
        if slot.owner != owner:
            raise Fenced("the receipt names another owner")
        now = time.monotonic()
        if now >= slot.deadline:
            slot.state, slot.due_at = SlotState.DUE, now
            state.due.add(token.offset)
            raise Fenced("the visibility timeout passed; the delivery will be redelivered")
        return state, slot

    def ack(self, token: Token, owner: str) -> None:
        state, _slot = self._slot_for(token, owner)
        del state.unacked[token.offset]
        self.commit()

    def release(self, token: Token, owner: str, delay_s: float) -> None:
        state, slot = self._slot_for(token, owner)
        slot.state, slot.due_at = SlotState.DUE, time.monotonic() + max(0.0, delay_s)
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
        commit already carried it, since that one may have failed unnoticed; so does any commit
        once a position was last sent ``commit_refresh_s`` ago (every claim commits).
        """
        now = time.monotonic()
        if not force and not synchronous and now - self._last_commit < self._commit_interval_s:
            if not self.dirty:
                self.dirty = True
                self._on_dirty()
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
            # On revoke and close, and now and then: even if an asynchronous commit already
            # carried it, confirm it.
            stale = now - state.sent_at >= self._commit_refresh_s
            if synchronous or resend or stale or state.committed != (position, metadata):
                offsets.append(TopicPartition(self._topic, partition, position, metadata))
                state.committed, state.sent_at = (position, metadata), now
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
            log.warning("kafka offset commit failed", extra={"kafka_error": describe(exc)})

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
        # librdkafka's close sends no LeaveGroup for a cooperative member that holds no partition
        # (the classic protocol's termination skips the leave when there is nothing to revoke).
        # The group then waits out the member's session timeout (45 s) before any rebalance
        # completes, so the partitions of workers that left properly sat idle too (seen when the
        # HPA scaled workers down). An unsubscribe first leaves through the path that does send
        # it; should it fail, the close below still runs (the member times out as before).
        with contextlib.suppress(KafkaException, RuntimeError):
            if not self.consumer.assignment():
                self.consumer.unsubscribe()
        try:
            # Leaves the group at once (the partitions move now, not after a session timeout).
            self.consumer.close()
        except (KafkaException, RuntimeError) as exc:
            log.warning("kafka consumer close failed", extra={"kafka_error": describe(exc)})
        self._parts.clear()


def work_item_id(message: Message) -> str:
    """The WorkItem id a record names in its header (empty when it names none)."""
    for key, value in message.headers() or []:
        if key == WORK_ITEM_HEADER and value is not None:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return ""
