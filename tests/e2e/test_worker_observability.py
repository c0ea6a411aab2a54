"""A worker process exposes its metrics and health, and heartbeats a Lease on the real API server."""

from __future__ import annotations

import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
from kubernetes import client

from agent_dispatch.models import WorkState
from testenv._common import free_port
from tests.e2e.harness import backend_env, start_worker, stop_all, submit, wait_states, wait_until
from tests.e2e.sink import FencingSink

METRICS = [
    "agent_dispatch_worker_heartbeat_timestamp_seconds",
    "agent_dispatch_turns_total",
    "agent_dispatch_turns_in_flight",
    "agent_dispatch_lease_renewals_total",
    "agent_dispatch_lease_failures_total",
    "agent_dispatch_claim_duration_seconds_bucket",
    "agent_dispatch_execute_duration_seconds_bucket",
    "agent_dispatch_commit_duration_seconds_bucket",
]
OUTCOMES = ["succeeded", "failed", "cancelled", "expired", "fenced", "poison", "dead_letter"]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""  # not listening yet


@pytest.mark.kube
def test_metrics_health_and_lease_heartbeat(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    kube_api: client.ApiClient,
    kubeconfig: Path,
    kube_namespace: str,
) -> None:
    port = free_port()
    backend = backend_env("sqlite", tmp_path, request, AGENT_DISPATCH_METRICS_PORT=str(port))
    settings, store, transport = backend.open()
    sink = FencingSink().start()
    try:
        proc = start_worker(
            backend,
            sink_url=sink.url,
            concurrency=2,
            log=tmp_path / "worker.log",
            extra={
                "KUBECONFIG": str(kubeconfig),
                "AGENT_DISPATCH_INSTANCE": "observed",
                "AGENT_DISPATCH_NAMESPACE": kube_namespace,
                "AGENT_DISPATCH_WORKER_ID": "worker-a",
            },
        )
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: get(f"{base}/readyz")[0] == 200, 30, "worker ready")
        assert get(f"{base}/healthz")[0] == 200
        assert get(f"{base}/nope")[0] == 404
        items = submit(settings, store, transport, 5)
        wait_states(store, [i.id for i in items], {WorkState.SUCCEEDED}, timeout=60)
        wait_until(
            lambda: 'agent_dispatch_turns_total{outcome="succeeded"} 5.0' in get(f"{base}/metrics")[1],
            30,
            "5",
        )
        text = get(f"{base}/metrics")[1]
        for name in METRICS:
            assert f"\n{name}" in text, name
        # One depth series per AgentDispatch comes from the metrics API; a per-pod copy of the
        # global depth would be multiplied by an adapter that sums over pods.
        assert "agent_dispatch_queue_depth" not in text
        for outcome in OUTCOMES:
            assert f'agent_dispatch_turns_total{{outcome="{outcome}"}}' in text

        leases = client.CoordinationV1Api(kube_api)
        selector = "agent-dispatch.io/instance=observed"
        wait_until(
            lambda: len(leases.list_namespaced_lease(kube_namespace, label_selector=selector).items) == 1,
            30,
            "Lease",
        )
        [lease] = leases.list_namespaced_lease(kube_namespace, label_selector=selector).items
        assert lease.spec.holder_identity == "worker-a"
        assert lease.spec.lease_duration_seconds == int(settings.claim_ttl_s)
        first: datetime = lease.spec.renew_time

        def renewed() -> bool:
            [again] = leases.list_namespaced_lease(kube_namespace, label_selector=selector).items
            return bool(again.spec.renew_time > first)

        wait_until(renewed, 10, "Lease renewed")
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        # A clean shutdown removes the Lease; a killed worker's Lease would go stale instead.
        assert leases.list_namespaced_lease(kube_namespace, label_selector=selector).items == []
    finally:
        stop_all(backend)
        sink.stop()
