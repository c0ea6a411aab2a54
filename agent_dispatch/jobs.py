"""The job status projection (``graph_jobs``): a read of, or a cancel through, the WorkItem authority.

There is no second status record anywhere: what this returns is the store's WorkItem, shaped
for the CLI, the gateway and agents that poll a job.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from agent_dispatch.errors import InvalidTransition
from agent_dispatch.models import WorkItem
from agent_dispatch.store import WorkItemStore

Action = Literal["status", "cancel"]
ACTIONS: Final = ("status", "cancel")
DEFAULT_CANCEL_REASON: Final = "cancelled by request"


def graph_jobs(
    store: WorkItemStore,
    action: Action | str = "status",
    *,
    job_id: str,
    tenant: str,
    reason: str = DEFAULT_CANCEL_REASON,
) -> dict[str, Any]:
    """Status of ``job_id`` for ``tenant``, or cancel it first (``action="cancel"``).

    ``NotFound`` for an unknown job or another tenant's. Cancelling a job that already ended
    is not an error: the projection says ``changed: False`` and shows how it ended.
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}; expected one of {', '.join(ACTIONS)}")
    changed = False
    if action == "cancel":
        try:
            item = store.cancel(job_id, tenant=tenant, reason=reason)
            changed = True
        except InvalidTransition:
            item = store.get(job_id, tenant=tenant)
    else:
        item = store.get(job_id, tenant=tenant)
    projection = project(item)
    if action == "cancel":
        projection["changed"] = changed
    return projection


def project(item: WorkItem) -> dict[str, Any]:
    """A JSON-ready view of a WorkItem (no payload: that stays in the store)."""

    def iso(value: Any) -> str | None:
        return None if value is None else str(value.isoformat())

    return {
        "job_id": item.id,
        "tenant": item.tenant,
        "kind": item.kind,
        "queue": item.queue,
        "session_id": item.session_id,
        "state": item.state.value,
        "terminal": item.terminal,
        "attempt": item.attempt,
        "max_attempts": item.max_attempts,
        "lease_epoch": item.lease_epoch,
        "fencing_token": item.fencing_token,
        "lease_owner": item.lease_owner,
        "priority": item.priority,
        "depends_on": list(item.depends_on),
        "timestamps": {
            "created_at": iso(item.created_at),
            "updated_at": iso(item.updated_at),
            "deadline": iso(item.deadline),
            "lease_expires_at": iso(item.lease_expires_at),
            "not_before": iso(item.not_before),
        },
        "outcome": None if item.outcome is None else item.outcome.value,
        "error": item.error,
    }
