"""The enqueue path (what the gateway and CLI call) and the recovery sweep's transport half.

Enqueue: fail-closed depth pre-check -> submit the WorkItem -> seal its envelope -> admit it
under the bound, by the :class:`Admission` strategy :func:`choose_admission` picks once per
store/transport pair from the capabilities they implement (``agent_dispatch.runtime`` does it at
start-up). The contract (docs/gateway.md, "Idempotency and refusals"):

- A refusal (``QueueFull``, ``DepthUnavailable``) leaves nothing under the request's idempotency
  key: a retry with the same key is admitted once there is room, as the same WorkItem. When the
  queue and the WorkItem store share one database (PostgreSQL, or the SQLite file), submit and
  admit run in ONE transaction. With the queue elsewhere (Kafka) the store's count of unfinished
  WorkItems is the bound, compared and admitted in the submit's transaction, and the envelope is
  produced after it. Otherwise (a store without that count: the in-memory one of unit tests) a
  refusal after the submit cancels the WorkItem with the reason, and that key is spent.
- A replay of an accepted key returns its WorkItem and admits nothing, also while the queue is
  full or its depth unknown (the refusal gives way to the existing item).
- A backend failure after the submit (the broker did not confirm the message, the queue's
  database failed) leaves the WorkItem ready and undispatched, and propagates: the outcome is
  unknown to the caller, as with a lost answer. The recovery sweep re-drives the item; a retry
  with the same key returns it. Never two WorkItems for one key.

:func:`redrive`: for every WorkItem the store reports as recoverable (expired lease, or ready and
not dispatched recently), admit its envelope again without the bound. Runs only while this
process holds the ``recovery-sweep`` leadership.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent_dispatch.dispatch._admission import (
    Admission,
    AfterSubmit,
    Counted,
    OneTransaction,
    choose_admission,
    shares_database,
)
from agent_dispatch.dispatch._redrive import RECOVERY_LEADER, default_stale_after_s, redrive
from agent_dispatch.dispatch._turns import build_turn, check_envelope_fields, precheck
from agent_dispatch.errors import DispatchError
from agent_dispatch.models import SubmitRequest, SubmitResult
from agent_dispatch.settings import Settings
from agent_dispatch.store import WorkItemStore
from agent_dispatch.transport import Transport


def enqueue(
    store: WorkItemStore,
    transport: Transport,
    request: SubmitRequest,
    *,
    signing_key: bytes,
    settings: Settings,
) -> SubmitResult:
    """One turn, for a caller without an :class:`Admission` at hand (it is chosen here, each call).

    Tests and one-off scripts only: every entry point admits through the strategy its
    :class:`agent_dispatch.runtime.Runtime` chose once (``Runtime.admission``)."""
    admission = choose_admission(store, transport, signing_key=signing_key, settings=settings)
    return admission.enqueue(request)


def enqueue_many(
    store: WorkItemStore,
    transport: Transport,
    requests: Sequence[SubmitRequest],
    *,
    signing_key: bytes,
    settings: Settings,
) -> list[SubmitResult | DispatchError]:
    """A batch, for a caller without an :class:`Admission` at hand; see :meth:`Admission.enqueue_many`."""
    admission = choose_admission(store, transport, signing_key=signing_key, settings=settings)
    return admission.enqueue_many(requests)


__all__ = [
    "RECOVERY_LEADER",
    "Admission",
    "AfterSubmit",
    "Counted",
    "OneTransaction",
    "build_turn",
    "check_envelope_fields",
    "choose_admission",
    "default_stale_after_s",
    "enqueue",
    "enqueue_many",
    "precheck",
    "redrive",
    "shares_database",
]
