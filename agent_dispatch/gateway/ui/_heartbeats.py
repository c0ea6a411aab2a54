"""Worker heartbeats for the overview: each worker's coordination.k8s.io Lease, when visible.

Workers in a cluster renew one Lease each (``agent_dispatch.worker._heartbeat``); the gateway
lists them by the instance label, as the doctor and the operator do, if it runs with
``AGENT_DISPATCH_INSTANCE`` and ``AGENT_DISPATCH_NAMESPACE`` and finds Kubernetes credentials (its
pod's ServiceAccount, or ``KUBECONFIG``). Anywhere else the overview says why there are none
rather than showing an empty list. One listing serves every page for ``CACHE_S``: the overview
polls every 2 s per open tab, and the API server should not see that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

from agent_dispatch.settings import Settings

log = logging.getLogger("agent_dispatch.gateway")

CACHE_S: Final = 5.0
LIST_TIMEOUT_S: Final = 5.0
NOT_ON_KUBERNETES: Final = (
    "Not on Kubernetes: workers renew no Lease here (in a cluster, set AGENT_DISPATCH_INSTANCE and "
    "AGENT_DISPATCH_NAMESPACE and the workers' Leases are shown)."
)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).isoformat()


class Heartbeats:
    """``read()``: ``{"source", "note", "workers": [{worker, holder, renewed_at, age_s, duration_s, live}]}``."""

    def __init__(
        self,
        settings: Settings,
        *,
        api_client: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._api_client = api_client or self._default_client
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._api: Any = None

    def _default_client(self) -> Any:
        from agent_dispatch.k8s_client import new_api_client

        return new_api_client(self._settings.kubeconfig, default_kubeconfig=False)

    def read(self) -> dict[str, Any]:
        with self._lock:
            now = self._clock()
            if self._cached is not None and now - self._cached[0] < CACHE_S:
                return self._cached[1]
            report = self._list()
            self._cached = (now, report)
            return report

    def _list(self) -> dict[str, Any]:
        s = self._settings
        if not (s.instance and s.namespace):
            return {"source": None, "note": NOT_ON_KUBERNETES, "workers": []}
        if self._api is None:
            self._api = self._api_client()
        if self._api is None:
            return {
                "source": None,
                "note": "No Kubernetes credentials here: worker Leases are not visible.",
                "workers": [],
            }
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        from agent_dispatch import k8s_names

        try:
            leases = client.CoordinationV1Api(self._api).list_namespaced_lease(
                s.namespace,
                label_selector=k8s_names.worker_lease_selector(s.instance),
                _request_timeout=LIST_TIMEOUT_S,
            )
        except ApiException as exc:
            note = (
                "This gateway may not list Leases (its Role needs list on leases)."
                if exc.status == 403
                else f"The API server answered {exc.status} listing worker Leases."
            )
            return {"source": "kubernetes", "note": note, "workers": []}
        except Exception as exc:  # unreachable API server: say so, keep the page up
            log.warning("web UI heartbeats: %s", type(exc).__name__)
            return {
                "source": "kubernetes",
                "note": "The Kubernetes API server cannot be reached.",
                "workers": [],
            }
        wall = datetime.now(UTC)
        workers = []
        for lease in leases.items:
            spec = lease.spec
            holder = spec.holder_identity if spec is not None else None
            renewed = k8s_names.parse_time(spec.renew_time) if spec is not None else None
            duration = (spec.lease_duration_seconds if spec is not None else None) or 0
            age = None if renewed is None else max((wall - renewed).total_seconds(), 0.0)
            workers.append(
                {
                    "worker": holder or lease.metadata.name,
                    "lease": lease.metadata.name,
                    "holder": holder,
                    "renewed_at": _iso(renewed),
                    "age_s": None if age is None else round(age, 1),
                    "duration_s": duration,
                    "live": age is not None and age <= duration,
                }
            )
        workers.sort(key=lambda w: str(w["worker"]))
        live = sum(w["live"] for w in workers)
        note = f"{live} live, {len(workers) - live} stale, from their Leases in namespace {s.namespace}."
        return {"source": "kubernetes", "note": note, "workers": workers}
