"""The enqueue path (what the gateway and CLI call) and the recovery sweep's transport half.

``enqueue``: fail-closed depth pre-check -> submit the WorkItem -> seal its envelope -> admit it
under the bound. The contract (docs/gateway.md, "Idempotency and refusals"):

- A refusal (``QueueFull``, ``DepthUnavailable``) leaves nothing under the request's idempotency
  key: a retry with the same key is admitted once there is room, as the same WorkItem. When the
  queue and the WorkItem store share one database (PostgreSQL, or the SQLite file), submit and
  admit run in ONE transaction. A transport that can reserve room (Kafka) is asked for it before
  the submit. Otherwise (a queue in another database: test layouts only) a refusal after the
  submit cancels the WorkItem with the reason, and that key is spent.
- A replay of an accepted key returns its WorkItem and admits nothing, also while the queue is
  full or its depth unknown (the refusal gives way to the existing item).
- A backend failure after the submit (the broker did not confirm the message, the queue's
  database failed) leaves the WorkItem ready and undispatched, and propagates: the outcome is
  unknown to the caller, as with a lost answer. The recovery sweep re-drives the item; a retry
  with the same key returns it. Never two WorkItems for one key.

``redrive``: for every WorkItem the store reports as recoverable (expired lease, or ready and
not dispatched recently), admit its envelope again without the bound. Runs only while this
process holds the ``recovery-sweep`` leadership.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Final, Protocol, runtime_checkable

from pydantic import ValidationError

from agent_dispatch.envelope import AgentTurnEnvelope, seal
from agent_dispatch.errors import (
    AdmissionRejected,
    DepthUnavailable,
    DispatchError,
    InvalidRequest,
    QueueFull,
)
from agent_dispatch.models import SubmitRequest, SubmitResult, WorkItem, WorkState, deterministic_id
from agent_dispatch.settings import RTO_S, Settings
from agent_dispatch.store import WorkItemStore, bound_error
from agent_dispatch.transport import OutboundTurn, Transport

log = logging.getLogger(__name__)

RECOVERY_LEADER: Final = "recovery-sweep"
#: Placeholder for fields the store assigns (id, default session) when pre-validating an envelope.
_PLACEHOLDER: Final = "pending"


@runtime_checkable
class _SharedStore(Protocol):
    """A store that can run the queue's admission inside its submit transaction."""

    @property
    def database_identity(self) -> str: ...

    def submit_in_transaction(
        self, request: SubmitRequest, then: Callable[[Any, WorkItem], None], *, dispatched: bool = False
    ) -> SubmitResult: ...


@runtime_checkable
class _SharedBatchStore(Protocol):
    """A store that can submit a whole batch in one transaction (and run the caller's admission in it)."""

    def submit_many_in_transaction(
        self,
        requests: Sequence[SubmitRequest],
        then: Callable[[Any, list[WorkItem]], None],
        *,
        dispatched: bool = False,
    ) -> list[SubmitResult | DispatchError]: ...


@runtime_checkable
class _Reservation(Protocol):
    """Room under the bound, held for turns not admitted yet."""

    @property
    def remaining(self) -> int: ...

    def admit(self, turns: Sequence[OutboundTurn]) -> None: ...

    def release(self) -> None: ...


@runtime_checkable
class _ReservingTransport(Protocol):
    """A transport that can reserve room under the bound before the WorkItems exist (Kafka)."""

    def reserve(self, count: int, *, partial: bool = False) -> _Reservation: ...


#: Errors that refuse a turn; any other failure after the submit leaves its outcome unknown.
_REFUSALS: Final = (QueueFull, DepthUnavailable)


@runtime_checkable
class _SharedTransport(Protocol):
    """A transport that can admit on a caller's connection, inside the caller's transaction."""

    @property
    def database_identity(self) -> str: ...

    def admit_on(self, conn: Any, turns: Sequence[OutboundTurn], *, bounded: bool = True) -> int: ...


def _ts(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def build_turn(item: WorkItem, *, signing_key: bytes) -> OutboundTurn:
    """The sealed envelope of ``item`` (references only: the body stays in the store)."""
    envelope = AgentTurnEnvelope(
        job_id=item.id,
        session_id=item.session_id,
        kind=item.kind,
        payload_ref=item.id,
        tenant=item.tenant,
        priority=item.priority,
        deadline=_ts(item.deadline),
        attempt=item.attempt,
        enqueued_at=time.time(),
    )
    return OutboundTurn(
        work_item_id=item.id,
        session_id=item.session_id,
        tenant=item.tenant,
        wire=seal(envelope, signing_key),
        priority=item.priority,
        deadline=_ts(item.deadline),
        fairness_group=item.fairness_group,
        not_before=_ts(item.not_before),
    )


def check_envelope_fields(request: SubmitRequest) -> None:
    """Refuse, before anything is stored, a request whose envelope could never be sealed."""
    try:
        AgentTurnEnvelope(
            job_id=request.work_item_id or _PLACEHOLDER,
            session_id=request.session_id or _PLACEHOLDER,
            kind=request.kind,
            payload_ref=_PLACEHOLDER,
            tenant=request.tenant,
            priority=request.priority,
            deadline=_ts(request.deadline),
            enqueued_at=0.0,
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or "request"
        raise InvalidRequest(f"{field}: {first['msg']}") from None


def precheck(transport: Transport, settings: Settings, count: int = 1) -> None:
    """Cheap fail-closed check before anything is written: an unknown depth rejects.

    Not authoritative (another submitter may take the room next); the transport's atomic
    compare-and-admit is. ``DepthUnavailable``/``QueueFull`` propagate.
    """
    depth = transport.depth()
    if depth + count > settings.max_depth:
        raise QueueFull(f"queue depth {depth} is at the bound {settings.max_depth}")


def _shares_database(store: WorkItemStore, transport: Transport) -> bool:
    return (
        isinstance(store, _SharedStore)
        and isinstance(transport, _SharedTransport)
        and store.database_identity == transport.database_identity
    )


def _admittable(item: WorkItem) -> bool:
    # A submitted item waits for its dependencies; the sweep dispatches it once it is ready.
    return item.state is WorkState.READY


def enqueue(
    store: WorkItemStore,
    transport: Transport,
    request: SubmitRequest,
    *,
    signing_key: bytes,
    settings: Settings,
) -> SubmitResult:
    """Admit one turn; see the module docstring. A replayed request returns the existing item."""
    check_envelope_fields(request)
    reservation: _Reservation | None = None
    try:
        if _reserving(store, transport):
            assert isinstance(transport, _ReservingTransport)
            reservation = transport.reserve(1)
        else:
            precheck(transport, settings)
    except _REFUSALS as exc:
        return _replay_or_raise(store, request, exc)
    try:
        return _enqueue_one(store, transport, request, signing_key=signing_key, reservation=reservation)
    finally:
        if reservation is not None:
            reservation.release()


def _reserving(store: WorkItemStore, transport: Transport) -> bool:
    return isinstance(transport, _ReservingTransport) and not _shares_database(store, transport)


def _existing_id(request: SubmitRequest) -> str | None:
    """The id a replay of ``request`` would find (None: every such request is new)."""
    if request.work_item_id is not None:
        return request.work_item_id
    if request.idempotency_key is not None:
        return deterministic_id(request.tenant, request.idempotency_key)
    return None


def _replay_or_raise(
    store: WorkItemStore, request: SubmitRequest, refusal: AdmissionRejected
) -> SubmitResult:
    """A refused request that repeats an accepted one gets that item (no admission); else the refusal."""
    item_id = _existing_id(request)
    if item_id is None:
        raise refusal
    try:
        store.get(item_id, tenant=request.tenant)
    except DispatchError:  # not there (or another tenant's), or the store is down too
        raise refusal from None
    result = store.submit(request)  # the stored item, or IdempotencyConflict for a different request
    if result.created:  # cannot happen (items are never deleted); never leave an unadmitted item
        _cancel_unadmitted(store, [result.item], refusal)
        raise refusal
    return result


def _replay_or_error(
    store: WorkItemStore, request: SubmitRequest, refusal: AdmissionRejected
) -> SubmitResult | DispatchError:
    try:
        return _replay_or_raise(store, request, refusal)
    except DispatchError as exc:
        return exc


def _enqueue_one(
    store: WorkItemStore,
    transport: Transport,
    request: SubmitRequest,
    *,
    signing_key: bytes,
    reservation: _Reservation | None = None,
) -> SubmitResult:
    if _shares_database(store, transport):
        assert isinstance(store, _SharedStore) and isinstance(transport, _SharedTransport)
        shared = transport

        def admit_in_submit(conn: Any, item: WorkItem) -> None:
            if _admittable(item):
                shared.admit_on(conn, [build_turn(item, signing_key=signing_key)], bounded=True)

        # The admission runs in the submit's transaction: the insert stamps the dispatch time.
        return store.submit_in_transaction(request, admit_in_submit, dispatched=True)
    result = store.submit(request)
    if not (result.created and _admittable(result.item)):
        return result
    _admit_after_submit(store, transport, [result.item], signing_key=signing_key, reservation=reservation)
    _mark_dispatched(store, [result.item.id])
    return result


def enqueue_many(
    store: WorkItemStore,
    transport: Transport,
    requests: Sequence[SubmitRequest],
    *,
    signing_key: bytes,
    settings: Settings,
) -> list[SubmitResult | DispatchError]:
    """Admit a batch; every request gets its own outcome, in order (one refusal hides no other).

    Admission is one batch where the transport allows it (one transaction, one flush barrier);
    when the bound leaves room for only some, as many as fit are accepted, one by one, and the
    rest get ``QueueFull``. The bound is never exceeded.
    """
    outcomes: list[SubmitResult | DispatchError | None] = [None] * len(requests)
    if _reserving(store, transport):
        return _enqueue_many_reserved(store, transport, requests, signing_key=signing_key, settings=settings)
    try:
        precheck(transport, settings)
    except _REFUSALS as exc:
        return [_answer_refused(store, request, exc) for request in requests]
    if _shares_database(store, transport):
        if isinstance(store, _SharedBatchStore) and not any(r.depends_on for r in requests):
            try:
                return _enqueue_batch_shared(store, transport, requests, signing_key=signing_key)
            except DispatchError:
                # Nothing of the batch was kept. Room for only some (QueueFull), or a failure of the
                # whole transaction: one by one below, so each request gets its own answer.
                pass
        for index, request in enumerate(requests):
            try:
                check_envelope_fields(request)
                outcomes[index] = _enqueue_one(store, transport, request, signing_key=signing_key)
            except DispatchError as exc:
                outcomes[index] = exc
        return [o for o in outcomes if o is not None]

    fresh: list[tuple[int, WorkItem]] = []
    submitted, stamped = _submit_each(store, requests)
    for index, result in submitted:
        outcomes[index] = result
        if isinstance(result, SubmitResult) and result.created and _admittable(result.item):
            fresh.append((index, result.item))
    items = [item for _, item in fresh]
    try:
        if items:
            transport.admit([build_turn(item, signing_key=signing_key) for item in items], bounded=True)
        admitted = [item.id for item in items]
    except QueueFull:
        # Room for some but not all: admit one at a time so each gets its own answer.
        admitted = []
        for index, item in fresh:
            try:
                _admit_after_submit(store, transport, [item], signing_key=signing_key)
                admitted.append(item.id)
            except DispatchError as exc:
                outcomes[index] = exc
    except BaseException as exc:
        if isinstance(exc, _REFUSALS):
            _cancel_unadmitted(store, items, exc)
        if not isinstance(exc, DispatchError):
            raise
        admitted = []
        for index, _ in fresh:
            outcomes[index] = exc
    if not stamped:
        _mark_dispatched(store, admitted)
    return [o for o in outcomes if o is not None]


def _sealable(
    requests: Sequence[SubmitRequest], outcomes: list[SubmitResult | DispatchError | None]
) -> list[int]:
    """The positions of the requests whose envelope can be sealed; the others' errors go into
    ``outcomes`` at their position."""
    valid: list[int] = []
    for index, request in enumerate(requests):
        try:
            check_envelope_fields(request)
            valid.append(index)
        except DispatchError as exc:
            outcomes[index] = exc
    return valid


def _answer_refused(
    store: WorkItemStore, request: SubmitRequest, refusal: AdmissionRejected
) -> SubmitResult | DispatchError:
    """One request of a refused batch: its own validation error, its replay, or the refusal."""
    try:
        check_envelope_fields(request)
    except DispatchError as exc:
        return exc
    return _replay_or_error(store, request, refusal)


def _enqueue_many_reserved(
    store: WorkItemStore,
    transport: Transport,
    requests: Sequence[SubmitRequest],
    *,
    signing_key: bytes,
    settings: Settings,
) -> list[SubmitResult | DispatchError]:
    """``enqueue_many`` on a transport that reserves room before the WorkItems are stored (Kafka).

    As much room as there is for the batch is reserved first; requests are submitted in order
    (a batch per store transaction) while room is left (a replay takes none); the rest can only
    be replays, else they get ``QueueFull`` with nothing stored. The new items are then produced
    in one batch in the reserved room, and what is left of it is released.
    """
    assert isinstance(transport, _ReservingTransport)
    outcomes: list[SubmitResult | DispatchError | None] = [None] * len(requests)
    valid = _sealable(requests, outcomes)
    if not valid:
        return [o for o in outcomes if o is not None]
    try:
        reservation = transport.reserve(len(valid), partial=True)
    except _REFUSALS as exc:
        for index in valid:
            outcomes[index] = _replay_or_error(store, requests[index], exc)
        return [o for o in outcomes if o is not None]
    to_mark: list[str] = []
    try:
        fresh: list[tuple[int, WorkItem]] = []
        stamped: set[str] = set()  # dispatch time already stamped by the batch insert
        pending = valid
        while pending:
            room = reservation.remaining - len(fresh)
            if room <= 0:
                break
            take, pending = pending[:room], pending[room:]
            submitted, stamps = _submit_each(store, [requests[i] for i in take])
            for position, result in submitted:
                outcomes[take[position]] = result
                if isinstance(result, SubmitResult) and result.created and _admittable(result.item):
                    fresh.append((take[position], result.item))
                    if stamps:
                        stamped.add(result.item.id)
        full = QueueFull(f"no room left under the depth bound {settings.max_depth} in this batch")
        for index in pending:
            outcomes[index] = _replay_or_error(store, requests[index], full)
        items = [item for _, item in fresh]
        try:
            reservation.admit([build_turn(item, signing_key=signing_key) for item in items])
            to_mark = [item.id for item in items if item.id not in stamped]
        except DispatchError as exc:
            # The broker did not confirm them: left ready for the recovery sweep to re-drive.
            for index, _ in fresh:
                outcomes[index] = exc
    finally:
        reservation.release()
    _mark_dispatched(store, to_mark)
    return [o for o in outcomes if o is not None]


def _submit_each(
    store: WorkItemStore, requests: Sequence[SubmitRequest]
) -> tuple[list[tuple[int, SubmitResult | DispatchError]], bool]:
    """Submit every request (no admission), each with its own outcome, in order; and whether the
    submit already stamped the dispatch time of the ready items.

    A store that can submit a batch in one transaction does so (requests with dependencies go
    one by one); a batch that fails as a whole is retried one by one, so each request still gets
    its own answer. The batch insert stamps the dispatch time, because the admission follows at
    once: a separate UPDATE after the admission would race the workers already taking the items.
    An item whose admission is then refused is cancelled (see ``_cancel_unadmitted``); one whose
    admission fails otherwise (outcome unknown), or whose cancel fails, is re-driven by the sweep
    once the stamp is ``stale_after`` old.
    """
    refused: list[SubmitResult | DispatchError | None] = [None] * len(requests)
    valid = _sealable(requests, refused)
    outcomes: list[tuple[int, SubmitResult | DispatchError]] = [
        (index, outcome) for index, outcome in enumerate(refused) if outcome is not None
    ]
    if isinstance(store, _SharedBatchStore) and not any(requests[i].depends_on for i in valid):
        try:
            results = store.submit_many_in_transaction(
                [requests[i] for i in valid], lambda conn, items: None, dispatched=True
            )
        except DispatchError:
            pass  # nothing of the batch was kept: one by one below
        else:
            outcomes.extend(zip(valid, results, strict=True))
            return sorted(outcomes, key=lambda pair: pair[0]), True
    for index in valid:
        try:
            outcomes.append((index, store.submit(requests[index])))
        except DispatchError as exc:
            outcomes.append((index, exc))
    return sorted(outcomes, key=lambda pair: pair[0]), False


def _enqueue_batch_shared(
    store: WorkItemStore,
    transport: Transport,
    requests: Sequence[SubmitRequest],
    *,
    signing_key: bytes,
) -> list[SubmitResult | DispatchError]:
    """The whole batch in one transaction: every submit, then one bounded admission of the new items.

    A ``DispatchError`` of the batch as a whole (``QueueFull``: it does not fit under the bound)
    rolls everything back and propagates, so the caller can fall back to one request at a time.
    """
    assert isinstance(transport, _SharedTransport) and isinstance(store, _SharedBatchStore)
    shared = transport
    outcomes: list[SubmitResult | DispatchError | None] = [None] * len(requests)
    valid = _sealable(requests, outcomes)

    def admit_all(conn: Any, items: list[WorkItem]) -> None:
        turns = [build_turn(item, signing_key=signing_key) for item in items if _admittable(item)]
        if turns:
            shared.admit_on(conn, turns, bounded=True)

    # The admission runs in the same transaction: the insert stamps the dispatch time.
    results = store.submit_many_in_transaction([requests[i] for i in valid], admit_all, dispatched=True)
    for index, result in zip(valid, results, strict=True):
        outcomes[index] = result
    return [o for o in outcomes if o is not None]


def _admit_after_submit(
    store: WorkItemStore,
    transport: Transport,
    items: Sequence[WorkItem],
    *,
    signing_key: bytes,
    reservation: _Reservation | None = None,
) -> None:
    """Admit stored ``items`` (in ``reservation`` if given, else under the bound), or raise.

    A refusal cancels them with the reason (a refused turn must never run). Any other failure
    (the broker did not confirm, the queue's database failed) leaves them ready and undispatched
    for the recovery sweep: they may have been enqueued already, and a retry with the same
    idempotency key must find them rather than a cancelled item.
    """
    if not items:
        return
    turns = [build_turn(item, signing_key=signing_key) for item in items]
    try:
        if reservation is not None:
            reservation.admit(turns)
        else:
            transport.admit(turns, bounded=True)
    except _REFUSALS as exc:
        _cancel_unadmitted(store, items, exc)
        raise


def _cancel_unadmitted(store: WorkItemStore, items: Sequence[WorkItem], exc: BaseException) -> None:
    """No orphans: a submitted item whose admission failed is cancelled, with the reason."""
    reason = bound_error(f"admission failed after submit: {type(exc).__name__}: {exc}") or ""
    for item in items:
        try:
            store.cancel(item.id, tenant=item.tenant, reason=reason)
        except Exception:  # the admission error matters more; the sweep re-drives a survivor
            log.exception("could not cancel a WorkItem whose admission failed", extra={"job_id": item.id})


def _mark_dispatched(store: WorkItemStore, work_item_ids: Sequence[str]) -> None:
    if not work_item_ids:
        return
    try:
        store.mark_dispatched(work_item_ids)
    except Exception:
        # Admitted already; at worst the sweep re-drives it early, which transports de-duplicate
        # (database queues) or workers absorb (idempotent ids).
        log.warning("could not record dispatch time", exc_info=True)


def default_stale_after_s(settings: Settings) -> float:
    """How long a ready item may go undelivered before the sweep re-drives it.

    No longer than the visibility timeout, and short enough that detection plus one sweep
    interval stays within the RTO.
    """
    return max(1.0, min(settings.effective_visibility_timeout_s, RTO_S - settings.sweep_interval_s))


def redrive(
    store: WorkItemStore,
    transport: Transport,
    *,
    settings: Settings,
    signing_key: bytes,
    stale_after_s: float | None = None,
    limit: int = 1000,
) -> int:
    """Re-admit the envelopes of recoverable WorkItems (unbounded); returns how many.

    Only the holder of the ``recovery-sweep`` leadership does this. Transports skip a work item
    that still has a queued delivery, so a re-drive never doubles a live one on the database
    queues.
    """
    if not store.try_lead(RECOVERY_LEADER):
        return 0
    stale = default_stale_after_s(settings) if stale_after_s is None else stale_after_s
    items = store.recoverable(stale_after_s=stale, limit=limit)
    turns: list[OutboundTurn] = []
    for item in items:
        try:
            turns.append(build_turn(item, signing_key=signing_key))
        except (DispatchError, ValidationError) as exc:
            # An item whose envelope can never be sealed would be re-driven forever: dead-letter it.
            store.dead_letter(item.id, reason=bound_error(f"envelope cannot be built: {exc}") or "")
    if not turns:
        return 0
    transport.admit(turns, bounded=False)
    store.mark_dispatched([t.work_item_id for t in turns])
    return len(turns)


__all__ = [
    "RECOVERY_LEADER",
    "build_turn",
    "check_envelope_fields",
    "default_stale_after_s",
    "enqueue",
    "enqueue_many",
    "precheck",
    "redrive",
]
