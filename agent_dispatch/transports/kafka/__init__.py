"""Kafka transport: topic ``agent_turns``, consumer group ``agent-dispatch``, key = session_id.

The parts, each in its own module, talk through callbacks, never each other's privates:

- ``_admin``: topic administration (create, grow, never shrink) and the consumer group's lag;
  the one place for it, also used by the operator and the doctor.
- ``_admission``: the depth signal (probed lag plus this process's turns in flight), and the
  fail-closed guard of a bounded ``admit``. It is not the admission bound of the enqueue path:
  that is the WorkItem store's count of unfinished items (``agent_dispatch.dispatch.Counted``).
- ``_producer``: one idempotent ``acks=all`` producer whose sends return once confirmed.
- ``_consumer`` (with ``_bookkeeping``): one worker thread's consumer, its receipts, redelivery
  and commits of the contiguous acknowledged prefix; ``_pool`` routes each thread to its own and
  ``_committer`` commits for the idle ones.
- ``_transport``: :class:`KafkaTransport`, the facade that wires them together.
"""

from __future__ import annotations

from agent_dispatch.transports.kafka._admin import (
    PartitionDecreaseRefused,
    TopicChange,
    admin_client,
    consumer_group_lag,
    ensure_topic,
    offsets_reader,
    topic_partition_count,
)
from agent_dispatch.transports.kafka._config import WORK_ITEM_HEADER, KafkaTuning
from agent_dispatch.transports.kafka._producer import DeliveryFailed
from agent_dispatch.transports.kafka._transport import KafkaTransport

__all__ = [
    "WORK_ITEM_HEADER",
    "DeliveryFailed",
    "KafkaTransport",
    "KafkaTuning",
    "PartitionDecreaseRefused",
    "TopicChange",
    "admin_client",
    "consumer_group_lag",
    "ensure_topic",
    "offsets_reader",
    "topic_partition_count",
]
