"""The AgentDispatch CRD on the real kube-apiserver: accepted, defaulted, and rejecting bad specs
with a message naming the field (CEL rules and the OpenAPI schema, enforced by the server)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubernetes import client

from agent_dispatch import k8s_names
from testenv.kube import ControlPlane
from tests.kube.conftest import agentdispatch, get_ad, kubectl_apply

pytestmark = pytest.mark.kube


def valid_spec() -> dict[str, Any]:
    return {
        "backend": "kafka",
        "partitions": 6,
        "kafka": {"bootstrapServers": "kafka-0.kafka:9092"},
        "signingKeySecretRef": {"name": "signing", "key": "key"},
        "worker": {"image": "agent-dispatch:test"},
    }


def with_(path: str, value: Any, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``spec`` (default: the valid one) with the dotted ``path`` set (None deletes it)."""
    result = copy.deepcopy(spec if spec is not None else valid_spec())
    *parents, leaf = path.split(".")
    node = result
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return result


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("claim TTL 301", with_("claimTtlSeconds", 301), "spec.claimTtlSeconds"),
    ("claim TTL 0", with_("claimTtlSeconds", 0), "spec.claimTtlSeconds"),
    (
        "renew equal to TTL",
        with_("renewIntervalSeconds", 60, with_("claimTtlSeconds", 60)),
        "spec.renewIntervalSeconds",
    ),
    (
        "renew above TTL",
        with_("renewIntervalSeconds", 90, with_("claimTtlSeconds", 60)),
        "spec.renewIntervalSeconds",
    ),
    ("zero depth", with_("maxDepth", 0), "spec.maxDepth"),
    ("negative depth", with_("maxDepth", -10), "spec.maxDepth"),
    (
        "postgres without a DSN secret",
        {"backend": "postgres", "worker": {"image": "x"}},
        "spec.postgres.dsnSecretRef",
    ),
    ("kafka without bootstrap servers", with_("kafka", {"topic": "t"}), "spec.kafka.bootstrapServers"),
    # Workers would crash-loop on "AGENT_DISPATCH_SIGNING_KEY is required" (found on a real node).
    ("kafka without a signing key", with_("signingKeySecretRef", None), "spec.signingKeySecretRef"),
    (
        "kafka servers both inline and from a secret",
        with_("kafka.bootstrapServersSecretRef", {"name": "k", "key": "servers"}),
        "spec.kafka.bootstrapServersSecretRef",
    ),
    (
        "inline connection string",
        {"backend": "postgres", "postgres": {"dsn": "postgresql://u:p@db/x"}, "worker": {"image": "x"}},
        "spec.postgres.dsn",
    ),
    (
        "connection string smuggled through worker env",
        with_("worker.env", [{"name": "STATE_DB_URI", "value": "postgresql://u:p@db/x"}]),
        "spec.worker.env",
    ),
    (
        "autoscaling max below min",
        with_("autoscaling", {"mode": "hpa", "minReplicas": 5, "maxReplicas": 2}),
        "spec.autoscaling.maxReplicas",
    ),
    (
        "kafka autoscaling max above partitions",
        with_("autoscaling", {"mode": "keda", "minReplicas": 0, "maxReplicas": 12}),
        "spec.autoscaling.maxReplicas",
    ),
    (
        "hpa scaling to zero",
        with_("autoscaling", {"mode": "hpa", "minReplicas": 0, "maxReplicas": 3}),
        "spec.autoscaling.minReplicas",
    ),
    ("sqlite with replicas", {"backend": "sqlite", "worker": {"image": "x", "replicas": 3}}, "spec.backend"),
    ("http executor without url", with_("worker.executor", {"name": "http"}), "spec.worker.executor.url"),
    ("unknown backend", with_("backend", "redis"), "spec.backend"),
    ("no worker image", with_("worker", {"replicas": 1}), "spec.worker.image"),
    (
        "secret name not a DNS name",
        with_("signingKeySecretRef", {"name": "Bad_Name", "key": "k"}),
        "spec.signingKeySecretRef.name",
    ),
]


@pytest.mark.parametrize(("label", "spec", "field"), INVALID, ids=[case[0] for case in INVALID])
def test_invalid_spec_is_rejected_naming_the_field(
    kube: ControlPlane,
    agentdispatch_crd: str,
    kube_namespace: str,
    label: str,
    spec: dict[str, Any],
    field: str,
) -> None:
    result = kubectl_apply(kube, kube_namespace, agentdispatch("bad", spec), check=False)
    assert result.returncode != 0, f"{label}: the API server accepted it"
    assert field in result.stderr, f"{label}: {result.stderr}"
    assert kube.kubectl("get", "adx", "bad", "-n", kube_namespace, check=False).returncode != 0


def test_name_too_long_is_rejected(kube: ControlPlane, agentdispatch_crd: str, kube_namespace: str) -> None:
    result = kubectl_apply(kube, kube_namespace, agentdispatch("a" * 57, valid_spec()), check=False)
    assert result.returncode != 0
    assert "metadata.name" in result.stderr


def test_valid_spec_is_accepted_with_defaults(
    kube: ControlPlane, agentdispatch_crd: str, kube_namespace: str, kube_api: client.ApiClient
) -> None:
    kubectl_apply(kube, kube_namespace, agentdispatch("good", valid_spec()))
    stored = get_ad(kube_api, kube_namespace, "good")
    assert stored is not None
    spec = stored["spec"]
    assert spec["claimTtlSeconds"] == 120
    assert spec["renewIntervalSeconds"] == 30
    assert spec["maxDepth"] == 100000
    assert spec["kafka"]["topic"] == "agent_turns"
    assert spec["worker"]["replicas"] == 1
    assert spec["worker"]["executor"] == {"name": "noop"}
    assert spec["worker"]["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    # The short name works through the real kubectl.
    assert kube.kubectl(
        "get", k8s_names.SHORT_NAME, "good", "-n", kube_namespace, "-o", "name"
    ).stdout.strip()


TRANSITIONS: list[tuple[str, dict[str, Any], str]] = [
    ("partitions decrease", with_("partitions", 3), "spec.partitions"),
    (
        "backend change",
        {**valid_spec(), "backend": "postgres", "postgres": {"dsnSecretRef": {"name": "p", "key": "d"}}},
        "spec.backend",
    ),
    ("topic change", with_("kafka.topic", "other"), "spec.kafka.topic"),
]


@pytest.mark.parametrize(("label", "spec", "field"), TRANSITIONS, ids=[case[0] for case in TRANSITIONS])
def test_transition_rules_reject_updates(
    kube: ControlPlane,
    agentdispatch_crd: str,
    kube_namespace: str,
    label: str,
    spec: dict[str, Any],
    field: str,
) -> None:
    kubectl_apply(kube, kube_namespace, agentdispatch("moving", valid_spec()))
    result = kubectl_apply(kube, kube_namespace, agentdispatch("moving", spec), check=False)
    assert result.returncode != 0, f"{label}: the API server accepted the update"
    assert field in result.stderr, result.stderr


def test_partitions_may_grow(kube: ControlPlane, agentdispatch_crd: str, kube_namespace: str) -> None:
    kubectl_apply(kube, kube_namespace, agentdispatch("growing", valid_spec()))
    kubectl_apply(kube, kube_namespace, agentdispatch("growing", with_("partitions", 12)))
    out = kube.kubectl("get", "adx", "growing", "-n", kube_namespace, "-o", "jsonpath={.spec.partitions}")
    assert out.stdout == "12"


def test_printer_columns_show_status_values(
    kube: ControlPlane, agentdispatch_crd: str, kube_namespace: str, kube_api: client.ApiClient
) -> None:
    kubectl_apply(kube, kube_namespace, agentdispatch("shown", valid_spec()))
    status = {
        "queueDepth": 42,
        "partitions": 6,
        "workers": {"live": 3, "stale": 1},
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Reconciled",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }
    kube.kubectl(
        "patch",
        "adx",
        "shown",
        "-n",
        kube_namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
    table = kube.kubectl("get", "agentdispatch", "-n", kube_namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "BACKEND", "DEPTH", "WORKERS", "READY", "AGE"]
    assert table[1].split()[:5] == ["shown", "kafka", "42", "3", "True"]
    wide = kube.kubectl("get", "agentdispatch", "-n", kube_namespace, "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-3:] == ["STALE", "PARTITIONS", "REASON"]
    assert wide[1].split()[-3:] == ["1", "6", "Reconciled"]


def test_status_is_a_subresource(
    kube: ControlPlane, agentdispatch_crd: str, kube_namespace: str, kube_api: client.ApiClient
) -> None:
    """A spec writer cannot set status through the main resource (the operator alone writes it)."""
    obj = agentdispatch("guarded", valid_spec())
    obj["status"] = {"queueDepth": 7}
    kubectl_apply(kube, kube_namespace, obj)
    stored = get_ad(kube_api, kube_namespace, "guarded")
    assert stored is not None and "queueDepth" not in (stored.get("status") or {})
