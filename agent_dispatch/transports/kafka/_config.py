"""What the producer, the consumers and the facade agree on: the work-item header and the tuning."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

#: Header carrying the WorkItem id, so a worker can name the item without trusting the envelope.
WORK_ITEM_HEADER: Final = "agent-dispatch-work-item"


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
    #: A consumer sends each partition's position again this long after it last sent it, even if
    #: nothing moved: an asynchronous commit can be lost without an error reaching its callback
    #: (a group coordinator moving while a cluster restarts), and an idle partition would then
    #: keep acknowledged turns counted in the lag for good.
    commit_refresh_s: float = 5.0
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
