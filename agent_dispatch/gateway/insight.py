"""What the web UI shows and does, on the gateway's service layer (beside :class:`JobService`).

A :class:`Scope` is who is looking: a tenant sees only its own jobs (another tenant's job is
``404``, as in the API), an administrator sees every tenant. Every read is bounded: the overview
reads the transport's depth counter, the lease-expiry index (``held_leases``) and the sampler's
history, never the whole table. The calls block; the gateway runs them on its thread pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from agent_dispatch.dispatch import build_turn
from agent_dispatch.errors import DispatchError, InvalidTransition, NotFound, QueueFull
from agent_dispatch.gateway._sampler import COUNTED, Sampler
from agent_dispatch.gateway.service import (
    JobService,
    ServiceError,
    is_job_id,
    not_found,
    parse_limit,
    parse_states,
    queue_full,
)
from agent_dispatch.jobs import project
from agent_dispatch.models import OutcomeRecord, WorkItem, WorkState
from agent_dispatch.store import Inspectable, TenantStats
from agent_dispatch.transport import Transport

#: Leases listed on the overview (soonest expiry first); the count beside it says if there are more.
LEASES_SHOWN: Final = 100
#: Tenants on one page of the tenants page.
TENANTS_PAGE: Final = 50
RETRY_REASON: Final = "retried from the web UI"
CANCEL_REASON: Final = "cancelled from the web UI"


@dataclass(frozen=True)
class Scope:
    """Who is looking: ``name`` is the tenant, or the administrator's name when ``admin``."""

    name: str
    admin: bool = False

    @property
    def tenant(self) -> str | None:
        """The tenant every read is limited to; ``None`` for an administrator."""
        return None if self.admin else self.name


def _iso(value: Any) -> str | None:
    return None if value is None else str(value.isoformat())


def timeline(records: list[OutcomeRecord]) -> list[dict[str, Any]]:
    """The outcome records grouped into attempts: one per lease epoch (epoch 0: before any claim)."""
    attempts: dict[int, dict[str, Any]] = {}
    for r in records:
        entry = attempts.setdefault(
            r.lease_epoch,
            {
                "lease_epoch": r.lease_epoch,
                "fencing_token": r.fencing_token,
                "owner": r.owner,
                "started_at": _iso(r.at),
                "ended_at": None,
                "outcome": None,
                "error": None,
                "events": [],
            },
        )
        entry["events"].append(
            {"event": r.event, "at": _iso(r.at), "owner": r.owner, "outcome": r.outcome, "detail": r.detail}
        )
        entry["owner"] = entry["owner"] or r.owner
        if r.event in {"commit", "retry", "dead_letter", "cancel", "expire", "defer"}:
            entry["ended_at"] = _iso(r.at)
            entry["outcome"] = r.outcome or r.event
            entry["error"] = r.detail
    return [attempts[k] for k in sorted(attempts)]


class InsightService:
    """The web UI's reads and actions over the runtime's store and transport."""

    def __init__(
        self,
        jobs: JobService,
        transport: Callable[[], Transport],
        signing_key: bytes,
        sampler: Sampler | None = None,
        heartbeats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        store = jobs.store
        if not isinstance(store, Inspectable):
            raise TypeError(f"{type(store).__name__} does not implement Inspectable")
        self.jobs = jobs
        self.store: Inspectable = store
        self._transport = transport
        self._signing_key = signing_key
        self.sampler = sampler or Sampler(store, lambda: transport().depth())
        #: Worker heartbeats (their Kubernetes Leases), or why there are none here.
        self.heartbeats = heartbeats or (lambda: {"source": None, "note": "", "workers": []})

    # --- reads -----------------------------------------------------------------------------------

    def overview(self, scope: Scope) -> dict[str, Any]:
        history = self.sampler.history()
        depth = history[-1].depth if history else None
        leases = [item for item in self.store.held_leases(limit=LEASES_SHOWN) if self._sees(scope, item)]
        workers: dict[str, list[dict[str, Any]]] = {}
        for item in leases:
            owner = item.lease_owner or "?"
            # A worker thread's owner is "<worker id>/<thread>": group the leases by worker.
            workers.setdefault(owner.rsplit("/", 1)[0], []).append(
                {
                    "job_id": item.id,
                    "tenant": item.tenant,
                    "owner": owner,
                    "state": item.state.value,
                    "lease_epoch": item.lease_epoch,
                    "fencing_token": item.fencing_token,
                    "expires_at": _iso(item.lease_expires_at),
                }
            )
        beats = self.heartbeats()
        return {
            "heartbeats": {
                "source": beats["source"],
                "note": beats["note"],
                # A tenant sees the workers serving its own jobs, not the whole fleet's names.
                "workers": beats["workers"]
                if scope.admin
                else [w for w in beats["workers"] if w["worker"] in workers],
            },
            "depth": depth,
            "max_depth": self.jobs.settings.max_depth,
            "rates_per_min": self.sampler.rates_per_min(),
            "totals": dict(self.sampler.totals),
            "since": self.sampler.started,
            "history": [{"at": s.at, "depth": s.depth, **{k: s.counts[k] for k in COUNTED}} for s in history],
            "workers": [{"worker": w, "leases": ls} for w, ls in sorted(workers.items())],
            "leases_shown": len(leases),
            "scope": {"name": scope.name, "admin": scope.admin},
        }

    def tenants(self, scope: Scope, *, after: str = "", limit: int | str | None = None) -> dict[str, Any]:
        """One page of tenants in name order, from the store's per-tenant counters.

        An administrator pages through every tenant (``after``: the last name of the previous
        page); a tenant sees its own row only. The cost is the page's size, not the queue's.
        """
        size = min(parse_limit(limit), TENANTS_PAGE) if limit else TENANTS_PAGE
        if scope.admin:
            found = self.store.tenant_stats(after=after[:200], limit=size + 1)
        else:
            found = self.store.tenant_stats(tenants=[scope.name]) or [
                TenantStats(scope.name, 0, 0, 0, None, None)
            ]
        page = found[:size]
        return {
            "tenants": [
                {
                    "tenant": t.tenant,
                    "queued": t.queued,
                    "running": t.running,
                    "done": t.done,
                    "oldest_waiting": _iso(t.oldest_waiting),
                    "last_served": _iso(t.last_served),
                }
                for t in page
            ],
            "next_after": page[-1].tenant if len(found) > size else None,
        }

    def list(
        self,
        scope: Scope,
        *,
        state: str = "",
        kind: str = "",
        session: str = "",
        tenant: str = "",
        limit: int | str | None = None,
        after: str = "",
    ) -> dict[str, Any]:
        states = parse_states([state] if state else [])
        size = parse_limit(limit)
        who = tenant or None if scope.admin else scope.name
        items = self.jobs.call(
            lambda: self.store.browse(
                tenant=who,
                states=states,
                kind=kind or None,
                session_id=session or None,
                limit=size + 1,
                after=after or None,
            )
        )
        page = items[:size]
        return {
            "jobs": [project(item) for item in page],
            "next_after": page[-1].id if len(items) > size else None,
        }

    def job(self, scope: Scope, job_id: str) -> dict[str, Any]:
        item = self._item(scope, job_id)
        view = project(item)
        view["payload_size"] = item.payload_size
        view["dependents"] = self.store.dependents(item.id)
        view["timeline"] = timeline(self.jobs.store.outcomes(item.id))
        view["can_cancel"] = not item.terminal
        view["can_retry"] = item.state.value == "dead_letter"
        return view

    # --- actions ---------------------------------------------------------------------------------

    def cancel(self, scope: Scope, job_id: str) -> dict[str, Any]:
        item = self._item(scope, job_id)
        self.jobs.cancel(item.tenant, item.id)
        return self.job(scope, job_id)

    def retry(self, scope: Scope, job_id: str) -> dict[str, Any]:
        """Send a dead-lettered job back to ready and admit a delivery for it at once.

        A job whose dependencies have not all succeeded goes back to waiting (``submitted``)
        instead, and is dispatched when its last dependency succeeds, like any waiting job.
        The job is unfinished again, so the store admits it under ``AGENT_DISPATCH_MAX_DEPTH``
        in the transition's own transaction: at the bound the retry is refused (``429``, as a
        submit is) and the job stays dead-lettered. Its delivery is then admitted unbounded, like
        the recovery sweep's re-drive: the store has counted it already. If admitting fails, the
        job is still ready and never dispatched, so the sweep re-drives it within the RTO.
        """
        item = self._item(scope, job_id)
        try:
            retried = self.store.retry_dead_letter(
                item.id, tenant=item.tenant, reason=RETRY_REASON, bound=self.jobs.settings.max_depth
            )
        except InvalidTransition as exc:
            raise ServiceError(409, "invalid_transition", str(exc)) from None
        except QueueFull:
            raise queue_full() from None
        if retried.state is not WorkState.READY:
            return self.job(scope, job_id)
        try:
            self._transport().admit([build_turn(retried, signing_key=self._signing_key)], bounded=False)
            self.jobs.store.mark_dispatched([retried.id])
        except DispatchError:
            pass  # the sweep re-drives it (it is ready and was never dispatched)
        return self.job(scope, job_id)

    # --- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _sees(scope: Scope, item: WorkItem) -> bool:
        return scope.admin or item.tenant == scope.name

    def _item(self, scope: Scope, job_id: str) -> WorkItem:
        if not is_job_id(job_id):
            raise not_found()
        try:
            return self.jobs.store.get(job_id, tenant=scope.tenant)
        except NotFound:
            raise not_found() from None
