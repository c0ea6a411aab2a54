"""The recovery sweep's transport half: re-admit the envelopes of WorkItems that lost theirs."""

from __future__ import annotations

from typing import Final

from pydantic import ValidationError

from agent_dispatch.dispatch._turns import build_turn
from agent_dispatch.errors import DispatchError
from agent_dispatch.settings import RTO_S, Settings
from agent_dispatch.store import WorkItemStore, bound_error
from agent_dispatch.transport import KnowsQueued, OutboundTurn, Transport

RECOVERY_LEADER: Final = "recovery-sweep"


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
    """Re-admit the envelopes of recoverable WorkItems (unbounded); returns how many were sent.

    Only the holder of the ``recovery-sweep`` leadership does this. A re-drive never doubles a
    queued delivery: the database queues skip such a turn on admit, and a transport that cannot
    (``KnowsQueued``: Kafka) is asked first. Every item looked at is stamped dispatched either
    way, so one still waiting behind a backlog is looked at again only after ``stale_after_s``.
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
    send = turns
    if isinstance(transport, KnowsQueued):
        queued = transport.queued_work_items()
        if queued:  # None (unknown just now): re-drive all, as safe as before, only noisier
            send = [turn for turn in turns if turn.work_item_id not in queued]
    if send:
        transport.admit(send, bounded=False)
    store.mark_dispatched([t.work_item_id for t in turns])
    return len(send)
