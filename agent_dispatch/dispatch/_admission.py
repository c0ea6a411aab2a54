"""The three admission strategies, and the choice between them (made once per store/transport pair).

- :class:`OneTransaction`: the queue lives in the WorkItem store's database (PostgreSQL, or the
  SQLite file). Submit and admit run in ONE transaction (the queue's counter and the store's
  count of unfinished items both compared in it), so a refusal keeps nothing.
- :class:`Counted`: the queue lives elsewhere (Kafka) and the store counts its unfinished
  WorkItems: the bounded submit compares and admits against that count in its own transaction,
  so a refusal keeps nothing, and the envelopes are produced after it.
- :class:`AfterSubmit`: anything else (a store without the count: the in-memory one of the unit
  tests, with a transport in another place). A refusal
  after the submit cancels the WorkItem with the reason, and that key is spent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final, Protocol

from agent_dispatch.dispatch._turns import (
    REFUSALS,
    Outcomes,
    admittable,
    answer_refused,
    build_turn,
    cancel_unadmitted,
    check_envelope_fields,
    mark_dispatched,
    precheck,
    presealed_turns,
    replay_or_raise,
    sealable,
    settled,
    submit_each,
    turn_of,
)
from agent_dispatch.errors import DispatchError, QueueFull
from agent_dispatch.models import SubmitRequest, SubmitResult, WorkItem
from agent_dispatch.settings import Settings
from agent_dispatch.store import BatchSubmit, CountsUnfinished, TransactionalSubmit, WorkItemStore
from agent_dispatch.transport import AdmitOnConnection, OutboundTurn, Transport

#: How long a pre-check that found the queue at most half full spares the next requests theirs
#: (:meth:`OneTransaction._precheck`).
ROOM_S: Final = 1.0


class Admission(Protocol):
    """Admits turns for one store/transport pair; see :mod:`agent_dispatch.dispatch`."""

    def enqueue(self, request: SubmitRequest) -> SubmitResult:
        """Admit one turn. A replayed request returns the existing item and admits nothing."""

    def enqueue_many(self, requests: Sequence[SubmitRequest]) -> Outcomes:
        """Admit a batch; every request gets its own outcome, in order (one refusal hides no other)."""


class _Strategy:
    #: What the pair must offer, said in the TypeError of a strategy built for a pair it does not fit.
    NEEDS = "nothing"

    def __init__(
        self, store: WorkItemStore, transport: Transport, *, signing_key: bytes, settings: Settings
    ) -> None:
        if not self.fits(store, transport):
            raise TypeError(f"{type(self).__name__} needs {self.NEEDS}")
        self.store = store
        self.transport = transport
        self.signing_key = signing_key
        self.settings = settings
        self._bind()

    def _bind(self) -> None:
        """Keep the pair under the capability types this strategy uses (it fits, so they hold)."""

    @classmethod
    def fits(cls, store: WorkItemStore, transport: Transport) -> bool:
        """Whether this pair offers the capabilities the strategy relies on."""
        return True

    def _turns(self, items: Sequence[WorkItem]) -> list[OutboundTurn]:
        return [build_turn(item, signing_key=self.signing_key) for item in items]

    def _admit_after_submit(self, items: Sequence[WorkItem]) -> None:
        """Admit stored ``items`` under the transport's bound, or raise.

        A refusal cancels them with the reason (a refused turn must never run). Any other failure
        (the broker did not confirm, the queue's database failed) leaves them ready and
        undispatched for the recovery sweep: they may have been enqueued already, and a retry
        with the same idempotency key must find them rather than a cancelled item.
        """
        if not items:
            return
        try:
            self.transport.admit(self._turns(items), bounded=True)
        except REFUSALS as exc:
            cancel_unadmitted(self.store, items, exc)
            raise

    def enqueue(self, request: SubmitRequest) -> SubmitResult:
        # One shape for every strategy: the checks before any write, then the strategy's ``_one``.
        check_envelope_fields(request)
        try:
            self._precheck()
        except REFUSALS as exc:
            return replay_or_raise(self.store, request, exc)
        return self._one(request)

    def _precheck(self) -> None:
        """Cheap fail-closed checks before any write (the counted strategy checks its count instead)."""
        precheck(self.transport, self.settings)

    def _one(self, request: SubmitRequest) -> SubmitResult:
        """Submit, then admit under the bound (a strategy that admits inside the submit overrides it)."""
        result = self.store.submit(request)
        if not (result.created and admittable(result.item)):
            return result
        self._admit_after_submit([result.item])
        mark_dispatched(self.store, [result.item.id])
        return result


class OneTransaction(_Strategy):
    """Submit and admit in one transaction of the database the store and the queue share.

    The queue's counter bounds the queued deliveries; the store's count of unfinished WorkItems
    (when the store keeps one: both database stores do) is compared in the same transaction, so
    turns waiting on a dependency, which have no delivery yet, count under the bound too.
    """

    NEEDS = "a store and a transport in one database"

    def _bind(self) -> None:
        store, transport = self.store, self.transport
        assert isinstance(store, TransactionalSubmit) and isinstance(transport, AdmitOnConnection)
        self._submitter = store
        self._queue = transport
        self._batch = store if isinstance(store, BatchSubmit) else None
        self._counter = store if isinstance(store, CountsUnfinished) else None
        self._room_until = 0.0  # time.monotonic() until which the pre-check is skipped

    def _precheck(self) -> None:
        """The pre-check only spares a full queue the transaction of each refused request: the
        admission in the transaction is the bound, and fails closed with it. So while the queue
        was seen, moments ago, at most half full, a request skips asking again (one round trip of
        a one-turn submit's six); near the bound every request asks."""
        if time.monotonic() < self._room_until:
            return
        depth = precheck(self.transport, self.settings)
        if 2 * (depth + 1) <= self.settings.max_depth:
            self._room_until = time.monotonic() + ROOM_S

    def _admit_unfinished(self, conn: Any, items: list[WorkItem]) -> None:
        # Last in the transaction, after the queue's counters: the lock order every writer keeps.
        if self._counter is not None:
            self._counter.admit_unfinished(conn, items, self.settings.max_depth)

    @classmethod
    def fits(cls, store: WorkItemStore, transport: Transport) -> bool:
        return shares_database(store, transport)

    def _one(self, request: SubmitRequest) -> SubmitResult:
        def admit_in_submit(conn: Any, item: WorkItem) -> None:
            if admittable(item):
                self._queue.admit_on(conn, self._turns([item]), bounded=True)
            self._admit_unfinished(conn, [item])

        # The admission runs in the submit's transaction: the insert stamps the dispatch time.
        return self._submitter.submit_in_transaction(request, admit_in_submit, dispatched=True)

    def enqueue_many(self, requests: Sequence[SubmitRequest]) -> Outcomes:
        try:
            self._precheck()
        except REFUSALS as exc:
            return [answer_refused(self.store, request, exc) for request in requests]
        if self._batch is not None and not any(r.depends_on for r in requests):
            try:
                return self._all_at_once(self._batch, requests)
            except DispatchError:
                # Nothing of the batch was kept. Room for only some (QueueFull), or a failure of the
                # whole transaction: one by one below, so each request gets its own answer.
                pass
        outcomes: Outcomes = []
        for request in requests:
            try:
                check_envelope_fields(request)
                outcomes.append(self._one(request))
            except DispatchError as exc:
                outcomes.append(exc)
        return outcomes

    def _all_at_once(self, store: BatchSubmit, requests: Sequence[SubmitRequest]) -> Outcomes:
        """Every submit, then one bounded admission of the new items, in one transaction.

        A ``DispatchError`` of the batch as a whole (``QueueFull``: it does not fit under the bound)
        rolls everything back and propagates, so the caller can fall back to one at a time.
        """
        outcomes: list[SubmitResult | DispatchError | None] = [None] * len(requests)
        valid = sealable(requests, outcomes)
        presealed = presealed_turns([requests[i] for i in valid], signing_key=self.signing_key)

        def admit_all(conn: Any, items: list[WorkItem]) -> None:
            turns = [
                turn_of(item, presealed, signing_key=self.signing_key) for item in items if admittable(item)
            ]
            if turns:
                self._queue.admit_on(conn, turns, bounded=True)
            self._admit_unfinished(conn, items)

        # The admission runs in the same transaction: the insert stamps the dispatch time.
        results = store.submit_many_in_transaction([requests[i] for i in valid], admit_all, dispatched=True)
        for index, result in zip(valid, results, strict=True):
            outcomes[index] = result
        return settled(outcomes)


class Counted(_Strategy):
    """The store's count of unfinished WorkItems is the bound (Kafka): compared and admitted as the
    last step of the submit's own transaction, so a refusal keeps nothing; the envelopes are
    produced after the commit.

    The transport's depth (Kafka: the consumer-group lag, which counts re-driven duplicates and
    offsets not yet committed) is not the bound; it is probed only because an unreachable broker
    must refuse before anything is stored (``DepthUnavailable``), and it stays the autoscaling
    signal. The envelopes go out with ``bounded=False``: the store has admitted them already.
    """

    NEEDS = "a store that counts its unfinished WorkItems and submits in a transaction"

    def _bind(self) -> None:
        store = self.store
        assert isinstance(store, CountsUnfinished) and isinstance(store, TransactionalSubmit)
        self._counter = store
        self._submitter = store
        self._batch = store if isinstance(store, BatchSubmit) else None

    @classmethod
    def fits(cls, store: WorkItemStore, transport: Transport) -> bool:
        return isinstance(store, CountsUnfinished) and isinstance(store, TransactionalSubmit)

    def _precheck(self) -> None:
        """Cheap fail-closed checks before any write: the broker answers, and the count has room.

        Not authoritative (the bounded submit is); they spare a full queue a transaction per
        refused request. ``DepthUnavailable``/``QueueFull`` propagate.
        """
        self.transport.depth()  # its value is a signal only; a failed probe refuses
        unfinished = self._counter.unfinished()
        if unfinished >= self.settings.max_depth:
            raise QueueFull(f"{unfinished} unfinished turns are at the bound {self.settings.max_depth}")

    def _admit_one(self, conn: Any, item: WorkItem) -> None:
        self._counter.admit_unfinished(conn, [item], self.settings.max_depth)

    def _admit_all(self, conn: Any, items: list[WorkItem]) -> None:
        self._counter.admit_unfinished(conn, items, self.settings.max_depth)

    def _one(self, request: SubmitRequest) -> SubmitResult:
        # The insert stamps the dispatch time: the produce follows at once.
        result = self._submitter.submit_in_transaction(request, self._admit_one, dispatched=True)
        if result.created and admittable(result.item):
            # Not confirmed (``DeliveryFailed``): the item stays ready, stamped, for the recovery
            # sweep, and the error propagates (the caller's outcome is unknown, as documented).
            self.transport.admit(self._turns([result.item]), bounded=False)
        return result

    def enqueue_many(self, requests: Sequence[SubmitRequest]) -> Outcomes:
        """The batch in one bounded transaction when it fits whole; else one by one, so as many as
        fit are accepted in order and the rest get ``QueueFull`` (a replay is always answered).
        The new ready items are produced in one batch at the end."""
        try:
            self._precheck()
        except REFUSALS as exc:
            return [answer_refused(self.store, request, exc) for request in requests]
        outcomes: list[SubmitResult | DispatchError | None] = [None] * len(requests)
        valid = sealable(requests, outcomes)
        results: list[SubmitResult | DispatchError] | None = None
        if self._batch is not None and valid and not any(requests[i].depends_on for i in valid):
            try:
                results = self._batch.submit_many_in_transaction(
                    [requests[i] for i in valid], self._admit_all, dispatched=True
                )
            except DispatchError:
                results = None  # nothing of the batch was kept (no room for all): one by one below
        if results is None:
            results = []
            for index in valid:
                try:
                    results.append(
                        self._submitter.submit_in_transaction(
                            requests[index], self._admit_one, dispatched=True
                        )
                    )
                except DispatchError as exc:
                    results.append(exc)
        fresh: list[tuple[int, WorkItem]] = []
        for index, result in zip(valid, results, strict=True):
            outcomes[index] = result
            if isinstance(result, SubmitResult) and result.created and admittable(result.item):
                fresh.append((index, result.item))
        if fresh:
            try:
                self.transport.admit(self._turns([item for _, item in fresh]), bounded=False)
            except DispatchError as exc:
                # Not confirmed: left ready (stamped) for the recovery sweep; each caller is told.
                for index, _ in fresh:
                    outcomes[index] = exc
        return settled(outcomes)


class AfterSubmit(_Strategy):
    """Submit, then admit under the bound; a refusal cancels what the submit stored."""

    def enqueue_many(self, requests: Sequence[SubmitRequest]) -> Outcomes:
        """Admission is one batch; when the bound leaves room for only some, as many as fit are
        accepted, one by one, and the rest get ``QueueFull``. The bound is never exceeded."""
        try:
            precheck(self.transport, self.settings)
        except REFUSALS as exc:
            return [answer_refused(self.store, request, exc) for request in requests]
        outcomes: list[SubmitResult | DispatchError | None] = [None] * len(requests)
        fresh: list[tuple[int, WorkItem]] = []
        submitted, stamped = submit_each(self.store, requests)
        for index, result in submitted:
            outcomes[index] = result
            if isinstance(result, SubmitResult) and result.created and admittable(result.item):
                fresh.append((index, result.item))
        items = [item for _, item in fresh]
        try:
            if items:
                self.transport.admit(self._turns(items), bounded=True)
            admitted = [item.id for item in items]
        except QueueFull:
            # Room for some but not all: admit one at a time so each gets its own answer.
            admitted = []
            for index, item in fresh:
                try:
                    self._admit_after_submit([item])
                    admitted.append(item.id)
                except DispatchError as exc:
                    outcomes[index] = exc
        except BaseException as exc:
            if isinstance(exc, REFUSALS):
                cancel_unadmitted(self.store, items, exc)
            if not isinstance(exc, DispatchError):
                raise
            admitted = []
            for index, _ in fresh:
                outcomes[index] = exc
        if not stamped:
            mark_dispatched(self.store, admitted)
        return settled(outcomes)


def shares_database(store: WorkItemStore, transport: Transport) -> bool:
    """Whether one transaction can span the store's submit and the transport's admission."""
    return (
        isinstance(store, TransactionalSubmit)
        and isinstance(transport, AdmitOnConnection)
        and store.database_identity == transport.database_identity
    )


def choose_admission(
    store: WorkItemStore, transport: Transport, *, signing_key: bytes, settings: Settings
) -> Admission:
    """The strategy for this pair, from the capabilities the two implement (see the module docstring):
    the first of these, in this order of preference, that fits the pair (``AfterSubmit`` fits any)."""
    strategy = next(s for s in (OneTransaction, Counted, AfterSubmit) if s.fits(store, transport))
    return strategy(store, transport, signing_key=signing_key, settings=settings)
