"""Helpers for worker tests: enqueue through the real envelope path, run a worker, wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from agent_dispatch.envelope import AgentTurnEnvelope, seal
from agent_dispatch.models import SubmitRequest, WorkItem
from agent_dispatch.store import WorkItemStore
from agent_dispatch.transport import OutboundTurn, Transport

KEY = b"k" * 40


def envelope_for(item: WorkItem, *, deadline: float | None = None) -> AgentTurnEnvelope:
    return AgentTurnEnvelope(
        job_id=item.id,
        session_id=item.session_id,
        kind=item.kind,
        payload_ref=item.id,
        tenant=item.tenant,
        priority=item.priority,
        deadline=deadline if deadline is not None else (item.deadline.timestamp() if item.deadline else None),
        attempt=item.attempt,
        enqueued_at=datetime.now(UTC).timestamp(),
    )


def enqueue(
    store: WorkItemStore,
    transport: Transport,
    *,
    tenant: str = "acme",
    session_id: str | None = None,
    payload: bytes = b"{}",
    kind: str = "turn",
    deadline: float | None = None,
    key: bytes = KEY,
) -> WorkItem:
    item = store.submit(SubmitRequest(tenant=tenant, kind=kind, payload=payload, session_id=session_id)).item
    wire = seal(envelope_for(item, deadline=deadline), key)
    transport.admit([OutboundTurn(item.id, item.session_id, tenant, wire, priority=item.priority)])
    return item


def wait_for(check: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
