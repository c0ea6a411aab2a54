"""The operator, run as ``python -m agent_dispatch.cli operator`` against the real kube-apiserver
(with kube-controller-manager where Deployments must roll), real PostgreSQL and real Kafka."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient
from kubernetes import client

from agent_dispatch import k8s_names
from agent_dispatch.operator import _reconcile
from agent_dispatch.operator._cluster import KubeCluster
from testenv.kube import ControlPlane
from tests.kube.conftest import (
    OperatorProcess,
    agentdispatch,
    condition,
    get_ad,
    kubectl_apply,
    wait_for,
)

pytestmark = pytest.mark.kube

IMAGE = "agent-dispatch:test-1"
#: The status timer runs every 10 s; allow a few rounds on a loaded machine.
STATUS_WAIT_S = 60


def make_secret(core: client.CoreV1Api, namespace: str, name: str, data: dict[str, str]) -> None:
    core.create_namespaced_secret(
        namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name=name),
            data={k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        ),
    )


def deployment(kube_api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        result = client.AppsV1Api(kube_api).read_namespaced_deployment(name, namespace)
    except client.exceptions.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    data: dict[str, Any] = kube_api.sanitize_for_serialization(result)
    return data


def service_exists(kube_api: client.ApiClient, namespace: str, name: str) -> bool:
    try:
        client.CoreV1Api(kube_api).read_namespaced_service(name, namespace)
    except client.exceptions.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def env_of(dep: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def events_for(kube: ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    out = kube.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}", "-o", "json"
    ).stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def reasons(kube: ControlPlane, namespace: str, name: str) -> list[tuple[str, str]]:
    return [(e["reason"], e.get("message", "")) for e in events_for(kube, namespace, name)]


def table_rows(text: str) -> list[dict[str, str]]:
    """kubectl's table output as dicts, sliced at the header's column starts (cells may be blank)."""
    lines = text.splitlines()
    header = lines[0]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    names = header.split()
    rows = []
    for line in lines[1:]:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


def write_lease(
    kube_api: client.ApiClient,
    namespace: str,
    instance: str,
    worker: str,
    duration_s: int,
    renewed: dt.datetime,
) -> None:
    """A worker heartbeat Lease exactly as the worker contract in agent_dispatch.k8s_names says."""
    api = client.CoordinationV1Api(kube_api)
    name = f"{instance}-worker-{worker}"
    body = {
        "apiVersion": k8s_names.LEASE_API_VERSION,
        "kind": "Lease",
        "metadata": {
            "name": name,
            "labels": {
                k8s_names.INSTANCE_LABEL: instance,
                k8s_names.COMPONENT_LABEL: k8s_names.WORKER_COMPONENT,
            },
        },
        "spec": {
            "holderIdentity": worker,
            "leaseDurationSeconds": duration_s,
            "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        },
    }
    try:
        api.create_namespaced_lease(namespace, body)
    except client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise
        api.patch_namespaced_lease(name, namespace, {"spec": body["spec"]})


# --------------------------------------------------------------------------------------------------


@pytest.mark.postgres
def test_lifecycle_create_roll_restart_workers_delete(
    kube: ControlPlane,
    kube_api: client.ApiClient,
    kube_namespace: str,
    operator_factory: Callable[..., OperatorProcess],
    postgres_dsn: str,
) -> None:
    ns = kube_namespace
    kube.start_controller_manager()  # Deployments get ReplicaSets; a template change rolls a new one
    core = client.CoreV1Api(kube_api)
    make_secret(core, ns, "pg", {"dsn": postgres_dsn})
    make_secret(core, ns, "signing", {"key": "k" * 40})
    operator = operator_factory(ns)

    spec = {
        "backend": "postgres",
        "postgres": {"dsnSecretRef": {"name": "pg", "key": "dsn"}},
        "signingKeySecretRef": {"name": "signing", "key": "key"},
        "claimTtlSeconds": 60,
        "renewIntervalSeconds": 10,
        "worker": {"image": IMAGE, "replicas": 2, "concurrency": 3},
    }
    kubectl_apply(kube, ns, agentdispatch("orders", spec))
    ad = wait_for(lambda: get_ad(kube_api, ns, "orders"), what="AgentDispatch")
    uid = ad["metadata"]["uid"]

    # -- creation: Deployment and Service with image, env and owner references ------------------
    dep = wait_for(lambda: deployment(kube_api, ns, "orders-worker"), STATUS_WAIT_S, what="worker Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == IMAGE
    env = env_of(dep)
    assert env["TASK_QUEUE_BACKEND"]["value"] == "postgres"
    assert env["AGENT_DISPATCH_CLAIM_TTL_S"]["value"] == "60"
    assert env["AGENT_DISPATCH_CONCURRENCY"]["value"] == "3"
    assert env["STATE_DB_URI"]["valueFrom"]["secretKeyRef"] == {"name": "pg", "key": "dsn"}
    assert env["AGENT_DISPATCH_SIGNING_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "signing", "key": "key"}
    assert dep["spec"]["replicas"] == 2
    owner = dep["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        k8s_names.KIND,
        "orders",
        uid,
        True,
    )
    assert wait_for(lambda: service_exists(kube_api, ns, "orders-worker"), what="worker Service")
    svc = client.CoreV1Api(kube_api).read_namespaced_service("orders-worker", ns)
    assert svc.metadata.owner_references[0].uid == uid

    # -- status: conditions, doctor, observedGeneration; the finalizer and annotations are ours ---
    def reconciled() -> dict[str, Any] | None:
        obj = get_ad(kube_api, ns, "orders")
        status = (obj or {}).get("status") or {}
        return obj if status.get("observedGeneration") == (obj or {})["metadata"]["generation"] else None

    ad = wait_for(reconciled, STATUS_WAIT_S, what="observedGeneration")
    assert condition(ad, "ConfigValid")["status"] == "True"
    assert condition(ad, "TransportReachable")["status"] == "True", ad["status"]
    assert condition(ad, "WorkersAvailable")["status"] == "False"  # no worker heartbeats yet
    assert condition(ad, "Ready")["reason"] == "NoLiveWorkers"
    checks = {c["name"]: c for c in ad["status"]["doctor"]["checks"]}
    assert checks["dispatch_lease_recovery"]["status"] == "ok"
    assert checks["transport"]["status"] == "ok"
    assert "pg" not in json.dumps(ad["status"]["doctor"]).replace('"pg"', "")  # nothing about the DSN
    assert postgres_dsn not in json.dumps(ad["status"])
    assert ad["metadata"]["finalizers"] == [k8s_names.FINALIZER]
    annotations = ad["metadata"].get("annotations") or {}
    assert f"{k8s_names.ANNOTATION_PREFIX}/{k8s_names.DIFFBASE_KEY}" in annotations
    assert not [key for key in annotations if key.startswith("kopf.zalando.org")]
    created = [r for r, _ in reasons(kube, ns, "orders") if r == "Created"]
    assert len(created) == 2, reasons(kube, ns, "orders")
    described = kube.kubectl("describe", "agentdispatch", "orders", "-n", ns).stdout
    assert "Conditions:" in described and "ConfigValid" in described
    assert "Deployment orders-worker created" in described

    # -- a spec change rolls the Deployment ---------------------------------------------------------
    first_generation = dep["metadata"]["generation"]
    spec["worker"]["image"] = "agent-dispatch:test-2"
    spec["claimTtlSeconds"] = 90
    kubectl_apply(kube, ns, agentdispatch("orders", spec))

    def rolled() -> dict[str, Any] | None:
        current = deployment(kube_api, ns, "orders-worker")
        if (
            current
            and current["spec"]["template"]["spec"]["containers"][0]["image"] == "agent-dispatch:test-2"
        ):
            return current
        return None

    dep = wait_for(rolled, STATUS_WAIT_S, what="rolled Deployment")
    assert env_of(dep)["AGENT_DISPATCH_CLAIM_TTL_S"]["value"] == "90"
    assert dep["metadata"]["generation"] > first_generation
    replica_sets = wait_for(
        lambda: (
            len(
                client.AppsV1Api(kube_api)
                .list_namespaced_replica_set(ns, label_selector=f"{k8s_names.INSTANCE_LABEL}=orders")
                .items
            )
            >= 2
        ),
        STATUS_WAIT_S,
        what="a second ReplicaSet (the rollout)",
    )
    assert replica_sets
    wait_for(
        lambda: ("Updated", "Deployment orders-worker updated") in reasons(kube, ns, "orders"),
        30,
        what="Updated event",
    )

    # -- restarting the operator repeats no creation ------------------------------------------------
    wait_for(reconciled, STATUS_WAIT_S, what="observedGeneration after the change")
    before = deployment(kube_api, ns, "orders-worker")
    assert before is not None
    svc_version = (
        client.CoreV1Api(kube_api).read_namespaced_service("orders-worker", ns).metadata.resource_version
    )
    events_before = len(events_for(kube, ns, "orders"))
    operator.stop()
    restarted_exactly = dt.datetime.now(dt.UTC)
    restarted_at = restarted_exactly.replace(microsecond=0)
    operator = operator_factory(ns)

    def resumed() -> bool:
        status = (get_ad(kube_api, ns, "orders") or {}).get("status") or {}
        stamp = status.get("lastReconcileTime")
        return bool(stamp) and dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")) >= restarted_at

    wait_for(resumed, STATUS_WAIT_S, what="the resumed reconcile after restart")
    after = deployment(kube_api, ns, "orders-worker")
    assert after is not None
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert (
        client.CoreV1Api(kube_api).read_namespaced_service("orders-worker", ns).metadata.resource_version
        == svc_version
    )

    def after_restart(event: dict[str, Any]) -> bool:
        # eventTime has microseconds: compare it exactly, so the old operator's last event, flushed
        # in the same second as the restart, is not taken for the new one's (a CI flake). The
        # older fields have whole seconds: compare them with the restart's second.
        if event.get("eventTime"):
            posted = dt.datetime.fromisoformat(str(event["eventTime"]).replace("Z", "+00:00"))
            return posted >= restarted_exactly
        raw = event.get("lastTimestamp") or event.get("firstTimestamp")
        return dt.datetime.fromisoformat(str(raw).replace("Z", "+00:00")) >= restarted_at

    # Events the restarted operator posted (the old one may still flush its last ones late).
    new_events = [e for e in events_for(kube, ns, "orders")[events_before:] if after_restart(e)]
    assert not [e for e in new_events if e["reason"] in {"Created", "Updated", "Deleted"}], [
        (e["reason"], e.get("message")) for e in new_events
    ]

    # -- workers: live from their Leases, stale within the TTL after they stop renewing -------------
    now = dt.datetime.now(dt.UTC)
    write_lease(kube_api, ns, "orders", "w-1", 8, now)
    write_lease(kube_api, ns, "orders", "w-2", 8, now)
    write_lease(kube_api, ns, "other", "w-9", 8, now)  # another instance's worker is not counted

    def workers(live: int, stale: int) -> Callable[[], bool]:
        def check() -> bool:
            found = ((get_ad(kube_api, ns, "orders") or {}).get("status") or {}).get("workers") or {}
            return bool(found.get("live") == live and found.get("stale") == stale)

        return check

    def both_renew() -> bool:
        # Live workers renew (as the worker's heartbeat does every interval) while we wait.
        for worker in ("w-1", "w-2"):
            write_lease(kube_api, ns, "orders", worker, 8, dt.datetime.now(dt.UTC))
        return workers(2, 0)()

    wait_for(both_renew, STATUS_WAIT_S, interval=1, what="two live workers")
    ad = get_ad(kube_api, ns, "orders")
    assert condition(ad, "WorkersAvailable")["status"] == "True"
    rows = table_rows(kube.kubectl("get", "agentdispatch", "-n", ns).stdout)
    assert list(rows[0]) == ["NAME", "BACKEND", "DEPTH", "WORKERS", "READY", "AGE"]
    # The operator migrated the database; the queue's admission counter reads 0.
    assert {k: rows[0][k] for k in ("NAME", "BACKEND", "DEPTH", "WORKERS", "READY")} == {
        "NAME": "orders",
        "BACKEND": "postgres",
        "DEPTH": "0",
        "WORKERS": "2",
        "READY": "True",
    }, rows
    # w-2 keeps renewing; w-1 "is killed" and stops. It must turn stale within TTL + one refresh.
    stopped_at = dt.datetime.now(dt.UTC)

    def w2_renews_and_w1_stale() -> bool:
        write_lease(kube_api, ns, "orders", "w-2", 8, dt.datetime.now(dt.UTC))
        return workers(1, 1)()

    wait_for(w2_renews_and_w1_stale, 8 + 10 + 15, interval=1, what="w-1 stale")
    assert (dt.datetime.now(dt.UTC) - stopped_at).total_seconds() < 8 + 10 + 15
    ad = get_ad(kube_api, ns, "orders")
    assert ad is not None and ad["status"]["workers"]["staleIds"] == ["w-1"]
    assert operator.liveness() is not None

    # -- deletion cleans up (the operator deletes the children, then releases its finalizer) --------
    kube.kubectl("delete", "agentdispatch", "orders", "-n", ns, "--wait=true", "--timeout=60s")
    assert get_ad(kube_api, ns, "orders") is None
    wait_for(lambda: deployment(kube_api, ns, "orders-worker") is None, 30, what="Deployment deleted")
    wait_for(lambda: not service_exists(kube_api, ns, "orders-worker"), 30, what="Service deleted")


def test_hpa_mode_targets_the_deployment_and_replicas_are_left_alone(
    kube: ControlPlane,
    kube_api: client.ApiClient,
    kube_namespace: str,
    operator_factory: Callable[..., OperatorProcess],
) -> None:
    ns = kube_namespace
    make_secret(client.CoreV1Api(kube_api), ns, "pg", {"dsn": "postgresql://nobody@127.0.0.1:1/none"})
    operator_factory(ns)
    spec = {
        "backend": "postgres",
        "postgres": {"dsnSecretRef": {"name": "pg", "key": "dsn"}},
        "signingKeySecretRef": {"name": "signing", "key": "key"},
        "worker": {"image": IMAGE, "replicas": 5},
        "autoscaling": {"mode": "hpa", "minReplicas": 2, "maxReplicas": 8, "targetDepthPerReplica": 20},
    }
    kubectl_apply(kube, ns, agentdispatch("scaled", spec))
    autoscaling = client.AutoscalingV2Api(kube_api)

    def hpa() -> Any:
        try:
            return autoscaling.read_namespaced_horizontal_pod_autoscaler("scaled-worker", ns)
        except client.exceptions.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    found = wait_for(hpa, STATUS_WAIT_S, what="HPA accepted by the API server")
    assert found.spec.scale_target_ref.kind == "Deployment"
    assert found.spec.scale_target_ref.name == "scaled-worker"
    assert (found.spec.min_replicas, found.spec.max_replicas) == (2, 8)
    metric = found.spec.metrics[0].external
    assert metric.metric.name == "agent_dispatch_queue_depth"
    assert metric.target.average_value == "20"
    dep = wait_for(lambda: deployment(kube_api, ns, "scaled-worker"), what="Deployment")

    def owned_by_operator(obj: dict[str, Any]) -> list[dict[str, Any]]:
        return [m for m in obj["metadata"]["managedFields"] if m["manager"] == k8s_names.FIELD_MANAGER]

    ours = owned_by_operator(dep)
    assert ours and all("f:replicas" not in json.dumps(m["fieldsV1"].get("f:spec", {})) for m in ours)

    # The HPA (here: someone else) sets replicas; a spec change must not take them back.
    client.AppsV1Api(kube_api).patch_namespaced_deployment_scale(
        "scaled-worker", ns, {"spec": {"replicas": 4}}, field_manager="horizontal-pod-autoscaler"
    )
    spec["maxDepth"] = 777
    kubectl_apply(kube, ns, agentdispatch("scaled", spec))

    def max_depth_rendered() -> bool:
        current = deployment(kube_api, ns, "scaled-worker")
        return current is not None and env_of(current)["AGENT_DISPATCH_MAX_DEPTH"]["value"] == "777"

    wait_for(max_depth_rendered, STATUS_WAIT_S, what="Deployment updated")
    dep = deployment(kube_api, ns, "scaled-worker")
    assert dep is not None and dep["spec"]["replicas"] == 4
    ad = wait_for(
        lambda: (obj := get_ad(kube_api, ns, "scaled")) and condition(obj, "TransportReachable") and obj,
        STATUS_WAIT_S,
        what="status",
    )
    assert condition(ad, "TransportReachable")["status"] == "False"
    assert "127.0.0.1" not in json.dumps(ad["status"])  # the doctor redacts addresses

    # Switching autoscaling off removes the HPA.
    spec["autoscaling"] = {"mode": "none"}
    kubectl_apply(kube, ns, agentdispatch("scaled", spec))
    wait_for(lambda: hpa() is None, STATUS_WAIT_S, what="HPA removed")
    wait_for(
        lambda: (deployment(kube_api, ns, "scaled-worker") or {})["spec"]["replicas"] == 5,
        30,
        what="replicas back under the operator",
    )
    kube.kubectl("delete", "agentdispatch", "scaled", "-n", ns, "--wait=true", "--timeout=60s")


def topic_partitions(bootstrap: str, topic: str) -> int | None:
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic=topic, timeout=15)
    found = metadata.topics.get(topic)
    return None if found is None or found.error is not None else len(found.partitions)


@pytest.mark.kafka
def test_kafka_partitions_grow_and_a_decrease_is_refused(
    kube: ControlPlane,
    kube_api: client.ApiClient,
    kube_namespace: str,
    operator_factory: Callable[..., OperatorProcess],
    kafka_bootstrap: str,
    kafka_topic_name: str,
) -> None:
    ns = kube_namespace
    make_secret(client.CoreV1Api(kube_api), ns, "kafka", {"servers": kafka_bootstrap})
    operator_factory(ns)
    spec = {
        "backend": "kafka",
        "partitions": 3,
        "kafka": {
            "bootstrapServersSecretRef": {"name": "kafka", "key": "servers"},
            "topic": kafka_topic_name,
            "replicationFactor": 1,
        },
        "signingKeySecretRef": {"name": "signing", "key": "key"},
        "worker": {"image": IMAGE},
    }
    kubectl_apply(kube, ns, agentdispatch("stream", spec))
    wait_for(
        lambda: topic_partitions(kafka_bootstrap, kafka_topic_name) == 3, STATUS_WAIT_S, what="topic created"
    )
    # A brand-new topic's first lag probe fails until its partitions have leaders: the reconcile
    # that created it waits for the probe (bounded), so the status never flaps to
    # TransportReachable=False on the way (every status seen is recorded).
    seen: list[str] = []

    def reachable_with_three() -> dict[str, Any] | None:
        obj = get_ad(kube_api, ns, "stream")
        if not obj or (obj.get("status") or {}).get("partitions") != 3:
            return None
        seen.append(condition(obj, "TransportReachable").get("status", ""))
        return obj if seen[-1] == "True" else None

    ad = wait_for(
        reachable_with_three,
        STATUS_WAIT_S,
        interval=0.2,
        what="status.partitions 3 and TransportReachable=True",
    )
    assert "False" not in seen, seen
    assert ad["status"]["queueDepth"] == 0
    assert ("TopicCreated", f"created topic {kafka_topic_name} with 3 partitions") in reasons(
        kube, ns, "stream"
    )

    # 3 -> 6 grows the real topic.
    spec["partitions"] = 6
    kubectl_apply(kube, ns, agentdispatch("stream", spec))
    wait_for(
        lambda: topic_partitions(kafka_bootstrap, kafka_topic_name) == 6, STATUS_WAIT_S, what="topic grown"
    )
    grown: list[str] = []

    def six_partitions() -> bool:
        obj = get_ad(kube_api, ns, "stream") or {}
        grown.append(condition(obj, "TransportReachable").get("status", "") if obj else "")
        return bool((obj.get("status") or {}).get("partitions") == 6)

    wait_for(six_partitions, STATUS_WAIT_S, interval=0.2, what="status.partitions 6")
    assert "False" not in grown, grown
    assert any(r == "PartitionsGrown" for r, _ in reasons(kube, ns, "stream"))
    dep = deployment(kube_api, ns, "stream-worker")
    assert dep is not None and env_of(dep)["AGENT_TURNS_PARTITIONS"]["value"] == "6"

    # 6 -> 3: the CRD's transition rule refuses it at the API server.
    spec["partitions"] = 3
    refused = kubectl_apply(kube, ns, agentdispatch("stream", spec), check=False)
    assert refused.returncode != 0 and "spec.partitions" in refused.stderr

    # Bypass the rule (a new object has no oldSelf): the operator refuses, changes nothing, says why.
    kube.kubectl("delete", "agentdispatch", "stream", "-n", ns, "--wait=true", "--timeout=60s")
    wait_for(lambda: deployment(kube_api, ns, "stream-worker") is None, 30, what="cleanup")
    kubectl_apply(kube, ns, agentdispatch("stream", spec))
    ad = wait_for(
        lambda: (
            (obj := get_ad(kube_api, ns, "stream"))
            and condition(obj, "Ready").get("reason") == "PartitionDecreaseRefused"
            and obj
        ),
        STATUS_WAIT_S,
        what="Ready=False PartitionDecreaseRefused",
    )
    ready = condition(ad, "Ready")
    assert ready["status"] == "False"
    assert "spec.partitions" in ready["message"] and "nothing changed" in ready["message"]
    assert ad["status"]["partitions"] == 6
    assert topic_partitions(kafka_bootstrap, kafka_topic_name) == 6
    assert deployment(kube_api, ns, "stream-worker") is None  # nothing was rolled out
    assert any(r == "PartitionDecreaseRefused" for r, _ in reasons(kube, ns, "stream"))
    wide = kube.kubectl("get", "adx", "stream", "-n", ns, "-o", "wide").stdout
    assert "PartitionDecreaseRefused" in wide

    # The reconcile function itself, called directly against the real API server and broker.
    outcome = _reconcile.reconcile(ad, KubeCluster(kube_api))
    assert outcome.changes == []
    assert outcome.observation.refused_reason == "PartitionDecreaseRefused"
    assert topic_partitions(kafka_bootstrap, kafka_topic_name) == 6
    kube.kubectl("delete", "agentdispatch", "stream", "-n", ns, "--wait=true", "--timeout=60s")


@pytest.mark.kafka
def test_keda_scaled_object_validates_against_kedas_crd(
    kube: ControlPlane,
    kube_api: client.ApiClient,
    kube_namespace: str,
    keda_crd: str,
    operator_factory: Callable[..., OperatorProcess],
    kafka_bootstrap: str,
    kafka_topic_name: str,
) -> None:
    ns = kube_namespace
    operator_factory(ns)
    spec = {
        "backend": "kafka",
        "partitions": 4,
        "kafka": {"bootstrapServers": kafka_bootstrap, "topic": kafka_topic_name},
        "signingKeySecretRef": {"name": "signing", "key": "key"},
        "worker": {"image": IMAGE},
        "autoscaling": {"mode": "keda", "minReplicas": 0, "maxReplicas": 4, "targetDepthPerReplica": 50},
    }
    kubectl_apply(kube, ns, agentdispatch("lagged", spec))
    custom = client.CustomObjectsApi(kube_api)

    def scaled_object() -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = custom.get_namespaced_custom_object(
                "keda.sh", "v1alpha1", ns, "scaledobjects", "lagged-worker"
            )
        except client.exceptions.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return found

    found = wait_for(scaled_object, STATUS_WAIT_S, what="ScaledObject accepted by KEDA's CRD")
    assert found["spec"]["scaleTargetRef"]["name"] == "lagged-worker"
    assert (found["spec"]["minReplicaCount"], found["spec"]["maxReplicaCount"]) == (0, 4)
    trigger = found["spec"]["triggers"][0]
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["lagThreshold"] == "50"
    assert trigger["metadata"]["topic"] == kafka_topic_name
    assert found["metadata"]["ownerReferences"][0]["kind"] == k8s_names.KIND
    dep = wait_for(lambda: deployment(kube_api, ns, "lagged-worker"), what="Deployment")
    assert "replicas" not in json.dumps(
        [
            m["fieldsV1"].get("f:spec", {})
            for m in dep["metadata"]["managedFields"]
            if m["manager"] == k8s_names.FIELD_MANAGER
        ]
    )

    # The PostgreSQL rendering is accepted by KEDA's schema too (server-side dry run), and the
    # schema is really enforced: the same object without a trigger type is refused.
    from agent_dispatch.operator import _desired, _spec

    pg = _desired.scaled_object(
        "pg",
        _spec.parse(
            {
                "backend": "postgres",
                "autoscaling": {"mode": "keda", "maxReplicas": 3},
                "worker": {"image": "x"},
            }
        ),
    )
    pg["metadata"]["namespace"] = ns
    kube.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(pg))
    del pg["spec"]["triggers"][0]["type"]
    broken = kube.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(pg), check=False)
    assert broken.returncode != 0 and "type" in broken.stderr
    kube.kubectl("delete", "agentdispatch", "lagged", "-n", ns, "--wait=true", "--timeout=60s")
    wait_for(lambda: scaled_object() is None, 30, what="ScaledObject deleted")


def test_worker_heartbeat_leases_fold_into_status(
    kube: ControlPlane,
    kube_api: client.ApiClient,
    kube_namespace: str,
    operator_factory: Callable[..., OperatorProcess],
) -> None:
    """The worker's own Lease heartbeat (agent_dispatch.worker) against the real API server: the
    contract between the worker and the operator, without a transport."""
    from agent_dispatch.worker._heartbeat import LeaseHeartbeat

    ns = kube_namespace
    operator_factory(ns)
    spec = {"backend": "sqlite", "claimTtlSeconds": 6, "renewIntervalSeconds": 2, "worker": {"image": IMAGE}}
    kubectl_apply(kube, ns, agentdispatch("beats", spec))
    beats = [
        LeaseHeartbeat(kube_api, ns, "beats", worker_id, duration_s=6, interval_s=2)
        for worker_id in ("w-1", "w-2")
    ]
    try:
        for beat in beats:
            beat.start()

        def counts() -> tuple[int, int]:
            found = ((get_ad(kube_api, ns, "beats") or {}).get("status") or {}).get("workers") or {}
            return int(found.get("live", -1)), int(found.get("stale", -1))

        wait_for(lambda: counts() == (2, 0), STATUS_WAIT_S, interval=1, what="two live workers")
        beats[0].stop(delete=False)  # as if killed: the Lease stays, unrenewed
        stopped_at = time.monotonic()
        wait_for(lambda: counts() == (1, 1), 6 + 10 + 20, interval=1, what="the stopped worker stale")
        assert time.monotonic() - stopped_at < 6 + 10 + 20
        ad = get_ad(kube_api, ns, "beats")
        assert ad is not None and ad["status"]["workers"]["staleIds"] == ["w-1"]
        assert ad["status"]["workers"]["liveIds"] == ["w-2"]
        beats[1].stop(delete=True)  # a clean shutdown removes the Lease
        wait_for(lambda: counts() == (0, 1), STATUS_WAIT_S, interval=1, what="clean shutdown counted")
    finally:
        for beat in beats:
            beat.stop(delete=True)
    kube.kubectl("delete", "agentdispatch", "beats", "-n", ns, "--wait=true", "--timeout=60s")


def test_real_workers_heartbeat_and_a_killed_one_turns_stale(
    kube: ControlPlane,
    kube_api: client.ApiClient,
    kube_namespace: str,
    operator_factory: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    """Two real ``agent-dispatch-worker`` processes publish Leases to the test API server; the
    operator shows them live, and a SIGKILLed one stale within its TTL plus one status refresh."""
    ns = kube_namespace
    operator_factory(ns)
    spec = {"backend": "sqlite", "claimTtlSeconds": 6, "renewIntervalSeconds": 2, "worker": {"image": IMAGE}}
    kubectl_apply(kube, ns, agentdispatch("live", spec))
    workers: list[subprocess.Popen[bytes]] = []
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("AGENT_DISPATCH_", "TASK_QUEUE", "STATE_DB"))
    }
    try:
        for worker_id in ("w-1", "w-2"):
            env = {
                **base,
                **kube.env,
                "TASK_QUEUE_BACKEND": "sqlite",
                "AGENT_DISPATCH_DATA_DIR": str(tmp_path / worker_id),
                "AGENT_DISPATCH_CLAIM_TTL_S": "6",
                "AGENT_DISPATCH_RENEW_INTERVAL_S": "2",
                "AGENT_DISPATCH_SIGNING_KEY": "s" * 40,
                "AGENT_DISPATCH_METRICS_PORT": "0",
                "AGENT_DISPATCH_INSTANCE": "live",
                "AGENT_DISPATCH_NAMESPACE": ns,
                "AGENT_DISPATCH_WORKER_ID": worker_id,
            }
            log = (tmp_path / f"{worker_id}.log").open("wb")
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "agent_dispatch.cli", "worker"],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )

        def counts() -> tuple[int, int]:
            found = ((get_ad(kube_api, ns, "live") or {}).get("status") or {}).get("workers") or {}
            for proc, worker_id in zip(workers, ("w-1", "w-2"), strict=True):
                if proc.poll() is not None and worker_id != "w-1":
                    log_text = (tmp_path / f"{worker_id}.log").read_text(errors="replace")[-2000:]
                    raise AssertionError(f"worker {worker_id} exited {proc.returncode}:\n{log_text}")
            return int(found.get("live", -1)), int(found.get("stale", -1))

        wait_for(lambda: counts() == (2, 0), STATUS_WAIT_S, interval=1, what="two live workers")
        ad = get_ad(kube_api, ns, "live")
        assert ad is not None and ad["status"]["workers"]["liveIds"] == ["w-1", "w-2"]
        assert condition(ad, "WorkersAvailable")["status"] == "True"

        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait(10)
        killed_at = time.monotonic()
        wait_for(lambda: counts() == (1, 1), 6 + 10 + 20, interval=1, what="the killed worker stale")
        assert time.monotonic() - killed_at < 6 + 10 + 20
        ad = get_ad(kube_api, ns, "live")
        assert ad is not None and ad["status"]["workers"]["staleIds"] == ["w-1"]
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    kube.kubectl("delete", "agentdispatch", "live", "-n", ns, "--wait=true", "--timeout=60s")
