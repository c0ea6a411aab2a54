"""What every admission strategy shares: sealing envelopes, the cheap depth pre-check, replays,
cancelling what a refusal left behind, and recording dispatch times."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Final

from pydantic import ValidationError

from agent_dispatch.envelope import AgentTurnEnvelope, seal
from agent_dispatch.errors import (
    AdmissionRejected,
    DepthUnavailable,
    DispatchError,
    InvalidRequest,
    QueueFull,
)
from agent_dispatch.models import SubmitRequest, SubmitResult, WorkItem, WorkState
from agent_dispatch.settings import Settings
from agent_dispatch.store import BatchSubmit, WorkItemStore, bound_error
from agent_dispatch.transport import OutboundTurn, Transport

log = logging.getLogger("agent_dispatch.dispatch")

#: Placeholder for fields the store assigns (id, default session) when pre-validating an envelope.
_PLACEHOLDER: Final = "pending"
#: Errors that refuse a turn; any other failure after the submit leaves its outcome unknown.
REFUSALS: Final = (QueueFull, DepthUnavailable)

Outcomes = list[SubmitResult | DispatchError]


def _ts(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def build_turn(item: WorkItem, *, signing_key: bytes) -> OutboundTurn:
    """The sealed envelope of ``item`` (references only: the body stays in the store)."""
    return _sealed_turn(
        item, item.id, item.session_id, item.attempt, _ts(item.not_before), signing_key=signing_key
    )


def _sealed_turn(
    item: WorkItem | SubmitRequest,
    item_id: str,
    session_id: str,
    attempt: int,
    not_before: float | None,
    *,
    signing_key: bytes,
) -> OutboundTurn:
    envelope = AgentTurnEnvelope(
        job_id=item_id,
        session_id=session_id,
        kind=item.kind,
        payload_ref=item_id,
        tenant=item.tenant,
        priority=item.priority,
        deadline=_ts(item.deadline),
        attempt=attempt,
        enqueued_at=time.time(),
    )
    return OutboundTurn(
        work_item_id=item_id,
        session_id=session_id,
        tenant=item.tenant,
        wire=seal(envelope, signing_key),
        priority=item.priority,
        deadline=_ts(item.deadline),
        fairness_group=item.fairness_group,
        not_before=not_before,
    )


def presealed_turns(requests: Sequence[SubmitRequest], *, signing_key: bytes) -> dict[str, OutboundTurn]:
    """The turns of the new items ``requests`` would create, sealed before the submit's write
    transaction (on SQLite it holds the file's only write lock), by item id. Only for requests
    whose id is known up front and that no other request of the batch names."""
    by_id: dict[str, SubmitRequest | None] = {}
    for request in requests:
        item_id = request.known_id
        if item_id is not None:
            by_id[item_id] = None if item_id in by_id else request
    return {
        item_id: _sealed_turn(
            request, item_id, request.session_id or item_id, 0, None, signing_key=signing_key
        )
        for item_id, request in by_id.items()
        if request is not None
    }


def turn_of(item: WorkItem, presealed: dict[str, OutboundTurn], *, signing_key: bytes) -> OutboundTurn:
    """``item``'s turn: the one sealed for it up front when it is the new item that was sealed for."""
    turn = presealed.get(item.id)
    fresh = item.attempt == 0 and item.not_before is None
    if (
        turn is None
        or not fresh
        or (turn.session_id, turn.priority, turn.deadline)
        != (
            item.session_id,
            item.priority,
            _ts(item.deadline),
        )
    ):
        return build_turn(item, signing_key=signing_key)
    return turn


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


def precheck(transport: Transport, settings: Settings, count: int = 1) -> int:
    """Cheap fail-closed check before anything is written: an unknown depth rejects. Returns the
    depth it read.

    Not authoritative (another submitter may take the room next); the transport's atomic
    compare-and-admit is. ``DepthUnavailable``/``QueueFull`` propagate.
    """
    depth = transport.depth()
    if depth + count > settings.max_depth:
        raise QueueFull(f"queue depth {depth} is at the bound {settings.max_depth}")
    return depth


def admittable(item: WorkItem) -> bool:
    # A submitted item waits for its dependencies; the sweep dispatches it once it is ready.
    return item.state is WorkState.READY


def sealable(
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


def settled(outcomes: list[SubmitResult | DispatchError | None]) -> Outcomes:
    return [o for o in outcomes if o is not None]


def replay_or_raise(store: WorkItemStore, request: SubmitRequest, refusal: AdmissionRejected) -> SubmitResult:
    """A refused request that repeats an accepted one gets that item (no admission); else the refusal."""
    item_id = request.known_id
    if item_id is None:
        raise refusal
    try:
        store.get(item_id, tenant=request.tenant)
    except DispatchError:  # not there (or another tenant's), or the store is down too
        raise refusal from None
    result = store.submit(request)  # the stored item, or IdempotencyConflict for a different request
    if result.created:  # cannot happen (items are never deleted); never leave an unadmitted item
        cancel_unadmitted(store, [result.item], refusal)
        raise refusal
    return result


def replay_or_error(
    store: WorkItemStore, request: SubmitRequest, refusal: AdmissionRejected
) -> SubmitResult | DispatchError:
    try:
        return replay_or_raise(store, request, refusal)
    except DispatchError as exc:
        return exc


def answer_refused(
    store: WorkItemStore, request: SubmitRequest, refusal: AdmissionRejected
) -> SubmitResult | DispatchError:
    """One request of a refused batch: its own validation error, its replay, or the refusal."""
    try:
        check_envelope_fields(request)
    except DispatchError as exc:
        return exc
    return replay_or_error(store, request, refusal)


def submit_each(
    store: WorkItemStore, requests: Sequence[SubmitRequest]
) -> tuple[list[tuple[int, SubmitResult | DispatchError]], bool]:
    """Submit every request (no admission), each with its own outcome, in order; and whether the
    submit already stamped the dispatch time of the ready items.

    A store that can submit a batch in one transaction does so (requests with dependencies go
    one by one); a batch that fails as a whole is retried one by one, so each request still gets
    its own answer. The batch insert stamps the dispatch time, because the admission follows at
    once: a separate UPDATE after the admission would race the workers already taking the items.
    An item whose admission is then refused is cancelled (see ``cancel_unadmitted``); one whose
    admission fails otherwise (outcome unknown), or whose cancel fails, is re-driven by the sweep
    once the stamp is ``stale_after`` old.
    """
    refused: list[SubmitResult | DispatchError | None] = [None] * len(requests)
    valid = sealable(requests, refused)
    outcomes: list[tuple[int, SubmitResult | DispatchError]] = [
        (index, outcome) for index, outcome in enumerate(refused) if outcome is not None
    ]
    if isinstance(store, BatchSubmit) and not any(requests[i].depends_on for i in valid):
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


def cancel_unadmitted(store: WorkItemStore, items: Sequence[WorkItem], exc: BaseException) -> None:
    """No orphans: a submitted item whose admission failed is cancelled, with the reason."""
    reason = bound_error(f"admission failed after submit: {type(exc).__name__}: {exc}") or ""
    for item in items:
        try:
            store.cancel(item.id, tenant=item.tenant, reason=reason)
        except Exception:  # the admission error matters more; the sweep re-drives a survivor
            log.exception("could not cancel a WorkItem whose admission failed", extra={"job_id": item.id})


def mark_dispatched(store: WorkItemStore, work_item_ids: Sequence[str]) -> None:
    if not work_item_ids:
        return
    try:
        store.mark_dispatched(work_item_ids)
    except Exception:
        # Admitted already; at worst the sweep re-drives it early, which transports de-duplicate
        # (database queues) or workers absorb (idempotent ids).
        log.warning("could not record dispatch time", exc_info=True)
