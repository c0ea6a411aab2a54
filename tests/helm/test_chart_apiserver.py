"""What the chart renders is accepted by the real kube-apiserver (server-side dry run, strict field
validation), with the default values and with every option switched on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from testenv.kube import ControlPlane
from tests.helm._support import CHART, CRD_FILE, by_kind, crd_established, manifests, render

pytestmark = pytest.mark.kube

SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"


def _service_monitor_crd() -> dict[str, Any]:
    """A stand-in for prometheus-operator's CRD (same group, version and names; an open schema),
    so the API server serves monitoring.coreos.com/v1 as a cluster with prometheus-operator does."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": SERVICE_MONITOR_CRD},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {
                "plural": "servicemonitors",
                "singular": "servicemonitor",
                "kind": "ServiceMonitor",
                "listKind": "ServiceMonitorList",
            },
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                            },
                        }
                    },
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def crds(kube: ControlPlane, kube_api: client.ApiClient) -> Iterator[None]:
    """The AgentDispatch CRD (the chart installs it from crds/ before its templates; a dry run of
    the templates needs it installed) and a ServiceMonitor CRD."""
    kube.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    ext = client.ApiextensionsV1Api(kube_api)
    created_monitor_crd = False
    try:
        ext.create_custom_resource_definition(_service_monitor_crd())
        created_monitor_crd = True
    except ApiException as exc:
        if exc.status != 409:
            raise
    crd_established(kube)
    kube.kubectl("wait", "--for=condition=Established", f"crd/{SERVICE_MONITOR_CRD}", "--timeout=60s")
    try:
        yield
    finally:
        if created_monitor_crd:
            with contextlib.suppress(ApiException):
                ext.delete_custom_resource_definition(SERVICE_MONITOR_CRD)


def _namespace(kube_api: client.ApiClient, name: str) -> str:
    with contextlib.suppress(ApiException):
        client.CoreV1Api(kube_api).create_namespace(
            client.V1Namespace(
                metadata=client.V1ObjectMeta(name=name, labels={"agent-dispatch.test/owner": "pytest"})
            )
        )
    return name


def _dry_run(kube: ControlPlane, namespace: str, text: str) -> str:
    """kubectl apply --dry-run=server with strict field validation; returns kubectl's report. Every
    namespaced object the chart renders names its namespace (several, with watchNamespaces)."""
    for doc in manifests(text):
        assert doc["kind"] in {"ClusterRole", "ClusterRoleBinding", "APIService"} or doc["metadata"].get(
            "namespace"
        ), doc
    proc = kube.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=text, check=False)
    assert proc.returncode == 0, f"the API server rejected the chart:\n{proc.stderr}"
    return proc.stdout


def _all_options(namespace: str, other: str) -> dict[str, Any]:
    return {
        "image": {"repository": "agent-dispatch", "tag": "9.9.9", "pullPolicy": "Always"},
        "imagePullSecrets": ["pull-secret"],
        "operator": {
            "logLevel": "DEBUG",
            "logFormat": "text",
            "metricsPort": 9100,
            "healthPort": 8081,
            "resources": {
                "requests": {"cpu": "100m", "memory": "96Mi"},
                "limits": {"cpu": 1, "memory": "512Mi"},
            },
            "extraEnv": [
                {"name": "EXTRA", "value": "1"},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            ],
            "podAnnotations": {"example.com/note": "yes"},
            "podLabels": {"team": "platform"},
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "priorityClassName": "",
        },
        "serviceAccount": {
            "create": True,
            "name": "dispatch-operator",
            "annotations": {"example.com/sa": "1"},
        },
        "rbac": {
            "create": True,
            "clusterWide": False,
            "watchNamespaces": [namespace, other],
            "secretNames": ["db-dsn", "kafka-bootstrap"],
            "keda": True,
        },
        "workers": {
            "serviceAccount": {
                "create": True,
                "name": "dispatch-worker",
                "annotations": {"example.com/w": "1"},
            },
            "rbac": {"create": True},
        },
        "metrics": {
            "service": True,
            "serviceMonitor": {
                "enabled": True,
                "interval": "15s",
                "scrapeTimeout": "5s",
                "labels": {"release": "prometheus"},
            },
        },
        "grafanaDashboard": {"enabled": True, "labels": {"grafana_dashboard": "1"}, "namespace": ""},
        "example": {"enabled": True, "name": "demo", "replicas": 1},
    }


def test_default_values_pass_a_server_side_dry_run(
    helm_bin: Path, kube: ControlPlane, kube_api: client.ApiClient, crds: None, tmp_path: Path
) -> None:
    namespace = _namespace(kube_api, "dry-defaults")
    text = render(helm_bin, tmp_path / "helm", namespace).stdout

    report = _dry_run(kube, namespace, text)

    for doc in manifests(text):
        assert (
            f"{doc['kind'].lower()}{_group(doc)}/{doc['metadata']['name']} created (server dry run)" in report
        )


def _group(doc: dict[str, Any]) -> str:
    """kubectl's "kind.group" spelling ("kind" alone for the core group)."""
    api_version = doc["apiVersion"]
    return "." + api_version.split("/")[0] if "/" in api_version else ""


@pytest.mark.parametrize("cluster_wide", [False, True], ids=["namespaced", "cluster-wide"])
def test_every_option_passes_a_server_side_dry_run(
    helm_bin: Path,
    kube: ControlPlane,
    kube_api: client.ApiClient,
    crds: None,
    tmp_path: Path,
    cluster_wide: bool,
) -> None:
    suffix = "cw" if cluster_wide else "ns"
    namespace = _namespace(kube_api, f"dry-all-{suffix}")
    other = _namespace(kube_api, f"dry-all-{suffix}-other")
    values = _all_options(namespace, other)
    values["rbac"]["clusterWide"] = cluster_wide
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))

    text = render(
        helm_bin,
        tmp_path / "helm",
        namespace,
        "-f",
        str(values_file),
        "--api-versions",
        "monitoring.coreos.com/v1",
    ).stdout
    docs = manifests(text)

    kinds = {doc["kind"] for doc in docs}
    expected = {
        "ServiceAccount",
        "Deployment",
        "Service",
        "ServiceMonitor",
        "ConfigMap",
        "AgentDispatch",
        "Role",
        "RoleBinding",
    }
    expected |= {"ClusterRole", "ClusterRoleBinding"} if cluster_wide else set()
    assert expected <= kinds
    (example,) = by_kind(docs, "AgentDispatch")
    assert example["spec"]["worker"]["serviceAccountName"] == "dispatch-worker"
    _dry_run(kube, namespace, text)


def test_the_dry_run_is_a_real_validator(
    helm_bin: Path, kube: ControlPlane, kube_api: client.ApiClient, crds: None, tmp_path: Path
) -> None:
    """The same path rejects what the API server would: an unknown field, an invalid value, and an
    AgentDispatch that breaks a CEL rule of the CRD."""
    namespace = _namespace(kube_api, "dry-negative")
    docs = manifests(render(helm_bin, tmp_path / "helm", namespace, "--set", "example.enabled=true").stdout)
    deployment = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-operator"))
    (example,) = by_kind(docs, "AgentDispatch")

    unknown = yaml.safe_load(yaml.safe_dump(deployment))
    unknown["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    invalid = yaml.safe_load(yaml.safe_dump(deployment))
    invalid["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "lots"
    too_long = yaml.safe_load(yaml.safe_dump(example))
    too_long["spec"]["claimTtlSeconds"] = 301

    for broken, message in (
        (unknown, "securityContxt"),
        (invalid, "quantities must match"),
        (too_long, "300"),
    ):
        proc = kube.kubectl(
            "apply",
            "--dry-run=server",
            "--validate=strict",
            "-f",
            "-",
            input=yaml.safe_dump(broken),
            check=False,
        )
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_chart_directory_has_no_stray_templates() -> None:
    """Every file under templates/ renders YAML or is a helper/NOTES; nothing slips in unrendered."""
    names = sorted(p.name for p in (CHART / "templates").iterdir())
    assert names == sorted(
        [
            "NOTES.txt",
            "_helpers.tpl",
            "deployment.yaml",
            "example-agentdispatch.yaml",
            "grafana-dashboard.yaml",
            "metrics-api-rbac.yaml",
            "metrics-api.yaml",
            "rbac.yaml",
            "service.yaml",
            "servicemonitor.yaml",
            "serviceaccount.yaml",
            "worker-rbac.yaml",
        ]
    )
