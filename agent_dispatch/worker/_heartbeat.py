"""One coordination.k8s.io/v1 Lease per worker, renewed like a kubelet's node lease.

The operator lists these by label and folds them into the AgentDispatch's ``.status``; a worker
whose Lease is not renewed within ``leaseDurationSeconds`` counts as stale.
"""

from __future__ import annotations

import logging
import re
import threading
from datetime import UTC, datetime
from typing import Any

from agent_dispatch import k8s_names as names

log = logging.getLogger(__name__)


def lease_name(instance: str, worker_id: str) -> str:
    name = re.sub(r"[^a-z0-9-]", "-", f"{instance}-worker-{worker_id}".lower()).strip("-")
    return name[:253].rstrip("-")


def lease_body(
    instance: str, worker_id: str, duration_s: int, now: datetime, pod_uid: str | None = None
) -> dict[str, Any]:
    """The Lease; with ``pod_uid``, owned by the worker's pod (named ``worker_id``), as a kubelet's
    node lease is owned by its Node, so it goes with the pod whatever the worker managed to do."""
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    owners = [{"apiVersion": "v1", "kind": "Pod", "name": worker_id, "uid": pod_uid}] if pod_uid else []
    return {
        "apiVersion": names.LEASE_API_VERSION,
        "kind": "Lease",
        "metadata": {
            "name": lease_name(instance, worker_id),
            "labels": {
                names.INSTANCE_LABEL: instance,
                names.COMPONENT_LABEL: names.WORKER_COMPONENT,
                names.NAME_LABEL: names.APP_NAME,
            },
            **({"ownerReferences": owners} if owners else {}),
        },
        "spec": {"holderIdentity": worker_id, "leaseDurationSeconds": duration_s, "renewTime": stamp},
    }


class LeaseHeartbeat:
    """Creates the worker's Lease, renews it every ``interval_s``, deletes it on clean shutdown."""

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        instance: str,
        worker_id: str,
        *,
        duration_s: int,
        interval_s: float,
        pod_uid: str | None = None,
    ) -> None:
        from kubernetes import client

        self._api = client.CoordinationV1Api(api_client)
        self._namespace = namespace
        self._instance = instance
        self._worker_id = worker_id
        self._duration_s = duration_s
        self._interval_s = interval_s
        self._pod_uid = pod_uid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lease-heartbeat", daemon=True)
        self.name = lease_name(instance, worker_id)
        self.renewals = 0

    def start(self) -> None:
        try:
            self.beat()
        except Exception:
            # The API server may be away (restarting): never fail the worker for it; the loop
            # keeps trying every interval, and the Lease appears once the server is back.
            log.warning("worker Lease not written yet; retrying", exc_info=True)
        self._thread.start()

    def beat(self) -> None:
        from kubernetes.client.exceptions import ApiException

        body = lease_body(self._instance, self._worker_id, self._duration_s, datetime.now(UTC), self._pod_uid)
        try:
            self._api.patch_namespaced_lease(self.name, self._namespace, body)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self._api.create_namespaced_lease(self._namespace, body)
        self.renewals += 1

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.beat()
            except Exception:
                log.warning("worker Lease renewal failed", exc_info=True)

    def stop(self, *, delete: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if delete:
            try:
                self._api.delete_namespaced_lease(self.name, self._namespace)
            except Exception:
                log.info("worker Lease not deleted", exc_info=True)
