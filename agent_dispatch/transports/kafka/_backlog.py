"""Which work items still have a delivery waiting in the topic, so a re-drive does not add another.

The recovery sweep re-admits every ready WorkItem that was not dispatched recently. On the database
queues the transport skips an item whose queue row still exists; Kafka has no such row to look up,
so without this every turn that waited behind a backlog longer than the sweep's threshold got a
second message. Each one then counted twice in the consumer-group lag (the depth that admission and
the autoscalers read) until both were consumed, which held the lag near its peak through a whole
drain, and its redelivery met the item leased by the first one and was released with a delay,
holding back the committed prefix of its partition as well.

A record is still queued when a consumer of the group will deliver it: it is at or past its
partition's committed offset and the last commit's metadata does not list it as acknowledged past
the prefix. Reading those records costs one pass over the unacknowledged part of the topic (at most
the depth bound), and only when the sweep has something to re-drive.
"""

from __future__ import annotations

import logging
import time
from typing import Final

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from agent_dispatch.transports.kafka._bookkeeping import Prior
from agent_dispatch.transports.kafka._client import client_config, describe
from agent_dispatch.transports.kafka._consumer import work_item_id

log = logging.getLogger(__name__)

#: Records read per consume() call while scanning.
_BATCH: Final = 500


def queued_work_items(
    bootstrap_servers: str, topic: str, group: str, *, timeout_s: float
) -> frozenset[str] | None:
    """Work item ids of the records ``group`` will still deliver on ``topic``.

    ``None`` when that cannot be read within about ``timeout_s`` (broker down, a backlog too long
    to scan in time): the caller then re-drives everything, as it would without this check.
    """
    deadline = time.monotonic() + max(0.1, timeout_s)
    reader = Consumer(
        {
            **client_config(bootstrap_servers, "agent-dispatch-backlog", "backlog"),
            # The group's id only to read its committed offsets: assign() never joins the group,
            # and nothing is ever committed.
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
        }
    )
    try:
        return _scan(reader, topic, deadline)
    except (KafkaException, TimeoutError) as exc:
        log.info("kafka backlog scan unavailable", extra={"kafka_error": describe(exc)})
        return None
    finally:
        reader.close()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _scan(reader: Consumer, topic: str, deadline: float) -> frozenset[str] | None:
    metadata = reader.list_topics(topic=topic, timeout=_left(deadline))
    found = metadata.topics.get(topic)
    if found is None or found.error is not None:
        return None
    parts = [TopicPartition(topic, p) for p in sorted(found.partitions)]
    committed = {tp.partition: tp for tp in reader.committed(parts, timeout=_left(deadline))}
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    priors: dict[int, Prior | None] = {}
    for tp in parts:
        low, high = reader.get_watermark_offsets(tp, timeout=_left(deadline), cached=False)
        mine = committed.get(tp.partition)
        start = mine.offset if mine is not None and mine.offset >= 0 else low
        start = max(start, low)
        if start < high:
            starts[tp.partition], ends[tp.partition] = start, high
            priors[tp.partition] = Prior.parse(mine.metadata if mine is not None else None)
    if not starts:
        return frozenset()
    reader.assign([TopicPartition(topic, p, offset) for p, offset in starts.items()])
    queued: set[str] = set()
    pending = set(starts)
    while pending:
        for message in reader.consume(_BATCH, timeout=min(0.5, _left(deadline))):
            err = message.error()
            partition, offset = message.partition(), message.offset()
            if partition is None or partition not in pending:
                continue
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(partition)
                    continue
                raise KafkaException(err)
            if offset is None:
                continue
            if offset >= ends[partition] - 1:
                pending.discard(partition)
            if offset < ends[partition] and _still_queued(priors[partition], offset):
                item = work_item_id(message)
                if item:
                    queued.add(item)
    return frozenset(queued)


def _still_queued(prior: Prior | None, offset: int) -> bool:
    """Whether the record at ``offset`` (at or past the committed offset) will be delivered again.

    Past what the last owner had delivered: yes. Within it: only if that owner listed it as
    unacknowledged; when it could not list them all ("u=*"), no record is trusted to be queued,
    so every stale item is re-driven as before.
    """
    if prior is None or offset > prior.delivered_through:
        return True
    return prior.unacked is not None and offset in prior.unacked
