"""The overview's worker heartbeats: Leases listed from the real kube-apiserver, or a plain note
where the gateway is not on Kubernetes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch.gateway.ui._heartbeats import CACHE_S, NOT_ON_KUBERNETES, Heartbeats
from agent_dispatch.gateway.ui._views import overview
from agent_dispatch.settings import load


def test_outside_kubernetes_the_overview_says_so() -> None:
    beats = Heartbeats(load()).read()
    assert beats == {"source": None, "note": NOT_ON_KUBERNETES, "workers": []}


@pytest.mark.kube
def test_each_workers_lease_is_shown_with_its_holder_renew_time_and_age(
    kube_api: Any, kubeconfig: Path, kube_namespace: str
) -> None:
    from agent_dispatch.worker._heartbeat import LeaseHeartbeat

    settings = load(
        AGENT_DISPATCH_INSTANCE="orders", AGENT_DISPATCH_NAMESPACE=kube_namespace, KUBECONFIG=str(kubeconfig)
    )
    now = [0.0]
    heartbeats = Heartbeats(settings, clock=lambda: now[0])
    assert heartbeats.read()["workers"] == []

    live = LeaseHeartbeat(kube_api, kube_namespace, "orders", "w-live", duration_s=60, interval_s=30)
    stale = LeaseHeartbeat(kube_api, kube_namespace, "orders", "w-stale", duration_s=1, interval_s=30)
    other = LeaseHeartbeat(kube_api, kube_namespace, "billing", "w-other", duration_s=60, interval_s=30)
    for heartbeat in (live, stale, other):
        heartbeat.beat()
    assert heartbeats.read()["workers"] == []  # one listing serves CACHE_S
    time.sleep(2.5)  # the 1 s lease of w-stale runs out
    now[0] += CACHE_S
    beats = heartbeats.read()
    assert beats["source"] == "kubernetes"
    assert [(w["worker"], w["holder"], w["live"]) for w in beats["workers"]] == [
        ("w-live", "w-live", True),
        ("w-stale", "w-stale", False),
    ]  # another instance's workers are not listed
    assert all(w["renewed_at"] and w["age_s"] >= 2.0 for w in beats["workers"])
    assert beats["note"].startswith("1 live, 1 stale")

    # The overview's workers table joins them with the WorkItem leases each worker holds.
    data = {
        "depth": 0,
        "max_depth": 10,
        "rates_per_min": {},
        "totals": {},
        "history": [],
        "heartbeats": beats,
        "workers": [
            {"worker": "w-live", "leases": [held("w-live/0", "j1"), held("w-live/1", "j2")]},
            {"worker": "w-gone", "leases": [held("w-gone/0", "j3")]},
        ],
        "leases_shown": 3,
    }
    rows = {r[0]: r for r in overview(data)["tables"]["worker-heartbeats"]}
    assert rows["w-live"][1] == "live" and rows["w-live"][5] == "2"
    assert rows["w-stale"][1] == "stale" and rows["w-stale"][5] == "0"
    assert rows["w-gone"][1] == "no Lease" and rows["w-gone"][5] == "1"


def held(owner: str, job_id: str) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "tenant": "t",
        "owner": owner,
        "state": "running",
        "lease_epoch": 1,
        "fencing_token": 1,
        "expires_at": None,
    }
