"""helm install / upgrade / uninstall against the real kube-apiserver, with the operator running under
the chart ServiceAccount's own token: its RBAC is sufficient, and no more than that."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from testenv.kube import ControlPlane
from tests.helm._support import (
    CHART,
    CRD_NAME,
    GROUP,
    PLURAL,
    RELEASE,
    ROOT,
    VERSION,
    ChartOperator,
    can,
    crd_established,
    get_ad,
    get_deployment,
    helm,
    leftovers,
    service_account_token,
    service_account_user,
    wait_for,
)

pytestmark = pytest.mark.kube

EXAMPLE = ROOT / "examples" / "agentdispatch-sqlite.yaml"
OPERATOR_SA = RELEASE
WORKER_SA = f"{RELEASE}-worker"


@pytest.fixture
def operators(
    kube: ControlPlane, kube_api: client.ApiClient, tmp_path: Path
) -> Iterator[list[ChartOperator]]:
    started: list[ChartOperator] = []
    yield started
    for operator in started:
        operator.stop()


@pytest.fixture
def installer(
    helm_bin: Path, kube: ControlPlane, kube_api: client.ApiClient, tmp_path: Path
) -> Iterator[Callable[..., str]]:
    """``install(namespace, *helm_args, release=RELEASE)``: helm install, uninstalled afterwards
    (cluster-scoped objects of a cluster-wide release must not outlive the test)."""
    installed: list[tuple[str, str]] = []

    def install(namespace: str, *args: str, release: str = RELEASE) -> str:
        helm(
            helm_bin, tmp_path / "helm", kube, "install", release, str(CHART), "--namespace", namespace, *args
        )
        installed.append((release, namespace))
        crd_established(kube)
        return release

    yield install
    for release, namespace in installed:
        helm(helm_bin, tmp_path / "helm", kube, "uninstall", release, "--namespace", namespace, check=False)


def _example(namespace: str, name: str = "example") -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": name, "namespace": namespace}
    return body


def _apply_example(kube: ControlPlane, namespace: str, name: str = "example") -> None:
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(_example(namespace, name)))


def _reconciled(kube_api: client.ApiClient, namespace: str, name: str = "example") -> Any:
    def done() -> Any:
        ad = get_ad(kube_api, namespace, name)
        status = (ad or {}).get("status") or {}
        deployment = get_deployment(kube_api, namespace, f"{name}-worker")
        generation = (ad or {}).get("metadata", {}).get("generation")
        return (
            deployment if deployment is not None and status.get("observedGeneration") == generation else None
        )

    return wait_for(done, 90, what=f"AgentDispatch {namespace}/{name} reconciled to its Deployment")


def _start_operator(
    kube: ControlPlane,
    kube_api: client.ApiClient,
    namespace: str,
    tmp_path: Path,
    operators: list[ChartOperator],
    fullname: str = RELEASE,
) -> ChartOperator:
    """Run the operator of the release whose full name is ``fullname`` (the release name when it
    contains "agent-dispatch", else <release>-agent-dispatch)."""
    operator = ChartOperator(kube, kube_api, namespace, tmp_path, deployment=f"{fullname}-operator").start()
    operators.append(operator)
    return operator


def _namespace(kube_api: client.ApiClient, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(kube_api).create_namespace(
        client.V1Namespace(
            metadata=client.V1ObjectMeta(name=name, labels={"agent-dispatch.test/owner": "pytest"})
        )
    )
    return name


def test_operator_with_the_chart_token_reconciles_an_agentdispatch(
    kube: ControlPlane,
    kube_api: client.ApiClient,
    kube_namespace: str,
    installer: Callable[..., str],
    operators: list[ChartOperator],
    tmp_path: Path,
) -> None:
    ns = kube_namespace
    installer(ns)
    operator = _start_operator(kube, kube_api, ns, tmp_path, operators)
    assert operator.argv[1:3] == [f"--namespace={ns}", f"--liveness=http://127.0.0.1:{operator.port}/healthz"]

    _apply_example(kube, ns)
    deployment = _reconciled(kube_api, ns)

    pod = deployment.spec.template.spec
    assert pod.service_account_name == WORKER_SA
    assert pod.containers[0].image == "agent-dispatch:0.1.0"
    assert pod.containers[0].command == ["agent-dispatch-worker"]
    assert pod.security_context.run_as_non_root is True
    owner = deployment.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.controller) == ("AgentDispatch", "example", True)
    client.CoreV1Api(kube_api).read_namespaced_service("example-worker", ns)
    # kopf posts events from a background queue: they may trail the reconcile by a moment.
    wait_for(
        lambda: any(
            e.involved_object.name == "example" and e.reason == "Created"
            for e in client.CoreV1Api(kube_api).list_namespaced_event(ns).items
        ),
        30,
        what="a Created event posted with the operator's token",
    )

    # A worker, with the worker ServiceAccount's own token, publishes its heartbeat Lease; the
    # operator (allowed to list Leases) folds it into .status.
    from agent_dispatch.worker._heartbeat import LeaseHeartbeat

    worker_kubeconfig = kube.kubeconfig_for_token(
        service_account_token(kube_api, ns, WORKER_SA), f"{ns}-worker"
    )
    worker_api = config.new_client_from_config(config_file=str(worker_kubeconfig), persist_config=False)
    heartbeat = LeaseHeartbeat(worker_api, ns, "example", "example-worker-0", duration_s=120, interval_s=5)
    try:
        heartbeat.start()
        status = wait_for(
            lambda: (
                ((get_ad(kube_api, ns, "example") or {}).get("status") or {}).get("workers", {}).get("live")
                == 1
                and get_ad(kube_api, ns, "example")
            ),
            60,
            what="one live worker in .status",
        )["status"]
        assert status["workers"]["liveIds"] == ["example-worker-0"]
    finally:
        heartbeat.stop(delete=True)
        worker_api.close()

    # Deleting the AgentDispatch: the operator removes its children and its finalizer.
    kube.kubectl("delete", "agentdispatch", "example", "-n", ns, "--timeout=60s")
    assert get_deployment(kube_api, ns, "example-worker") is None
    with pytest.raises(ApiException) as gone:
        client.CoreV1Api(kube_api).read_namespaced_service("example-worker", ns)
    assert gone.value.status == 404

    assert operator.forbidden() == [], operator.tail()


def test_subject_access_reviews_show_what_the_operator_cannot_do(
    kube_api: client.ApiClient, kube_namespace: str, installer: Callable[..., str]
) -> None:
    ns = kube_namespace
    other = "kube-system"
    installer(ns, "--set", "rbac.secretNames={db-dsn}")
    operator = service_account_user(ns, OPERATOR_SA)
    worker = service_account_user(ns, WORKER_SA)

    def allowed(subject: tuple[str, list[str]], verb: str, resource: str, **kw: Any) -> bool:
        return can(kube_api, subject, verb, resource, **kw)

    # What it needs (the operator test above proves these suffice).
    assert allowed(operator, "watch", PLURAL, group=GROUP, namespace=ns)
    assert allowed(operator, "patch", PLURAL, group=GROUP, namespace=ns, subresource="status")
    assert allowed(operator, "create", "deployments", group="apps", namespace=ns)
    assert allowed(operator, "delete", "services", namespace=ns)
    assert allowed(operator, "get", "secrets", namespace=ns, name="db-dsn")
    assert allowed(worker, "create", "leases", group="coordination.k8s.io", namespace=ns)

    denied = {
        # Secrets it was not granted, and listing Secrets at all (which would reveal every one).
        "get another Secret": allowed(operator, "get", "secrets", namespace=ns, name="other"),
        "list Secrets": allowed(operator, "list", "secrets", namespace=ns),
        "watch Secrets": allowed(operator, "watch", "secrets", namespace=ns),
        "get Secret db-dsn elsewhere": allowed(operator, "get", "secrets", namespace=other, name="db-dsn"),
        # Other namespaces, in namespaced mode.
        "list AgentDispatches elsewhere": allowed(operator, "list", PLURAL, group=GROUP, namespace=other),
        "list AgentDispatches cluster-wide": allowed(operator, "list", PLURAL, group=GROUP),
        "create Deployments elsewhere": allowed(
            operator, "create", "deployments", group="apps", namespace=other
        ),
        "create Events elsewhere": allowed(operator, "create", "events", namespace=other),
        # RBAC escalation: no role, binding, bind, escalate or impersonation.
        "create ClusterRoles": allowed(operator, "create", "clusterroles", group="rbac.authorization.k8s.io"),
        "create ClusterRoleBindings": allowed(
            operator, "create", "clusterrolebindings", group="rbac.authorization.k8s.io"
        ),
        "create Roles": allowed(operator, "create", "roles", group="rbac.authorization.k8s.io", namespace=ns),
        "create RoleBindings": allowed(
            operator, "create", "rolebindings", group="rbac.authorization.k8s.io", namespace=ns
        ),
        "bind ClusterRoles": allowed(operator, "bind", "clusterroles", group="rbac.authorization.k8s.io"),
        "escalate Roles": allowed(
            operator, "escalate", "roles", group="rbac.authorization.k8s.io", namespace=ns
        ),
        "impersonate": allowed(operator, "impersonate", "serviceaccounts", namespace=ns),
        "create tokens": allowed(operator, "create", "serviceaccounts", namespace=ns, subresource="token"),
        # No workload it does not render, no pods, no CRDs, no deleting AgentDispatches.
        "create Pods": allowed(operator, "create", "pods", namespace=ns),
        "exec into Pods": allowed(operator, "create", "pods", namespace=ns, subresource="exec"),
        "update the CRD": allowed(
            operator, "update", "customresourcedefinitions", group="apiextensions.k8s.io", name=CRD_NAME
        ),
        "delete AgentDispatches": allowed(operator, "delete", PLURAL, group=GROUP, namespace=ns),
        "list namespaces": allowed(operator, "list", "namespaces"),
        # Workers: only their Leases.
        "worker reads Secrets": allowed(worker, "get", "secrets", namespace=ns, name="db-dsn"),
        "worker lists AgentDispatches": allowed(worker, "list", PLURAL, group=GROUP, namespace=ns),
        "worker creates Leases elsewhere": allowed(
            worker, "create", "leases", group="coordination.k8s.io", namespace=other
        ),
    }
    assert [what for what, granted in denied.items() if granted] == []


def test_cluster_wide_mode_reconciles_in_any_namespace_and_still_cannot_escalate(
    kube: ControlPlane,
    kube_api: client.ApiClient,
    kube_namespace: str,
    installer: Callable[..., str],
    operators: list[ChartOperator],
    tmp_path: Path,
) -> None:
    ns = kube_namespace
    release = f"adcw-{uuid.uuid4().hex[:6]}"  # ClusterRole names are cluster-wide: one per test run
    installer(ns, "--set", "rbac.clusterWide=true", release=release)
    fullname = f"{release}-agent-dispatch"
    operator_user = service_account_user(ns, fullname)
    elsewhere = _namespace(kube_api, "cw-target")

    assert can(kube_api, operator_user, "list", PLURAL, group=GROUP)
    assert can(kube_api, operator_user, "create", "deployments", group="apps", namespace=elsewhere)
    assert not can(kube_api, operator_user, "get", "secrets", namespace=elsewhere, name="anything")
    assert not can(
        kube_api, operator_user, "create", "clusterrolebindings", group="rbac.authorization.k8s.io"
    )
    assert not can(kube_api, operator_user, "bind", "clusterroles", group="rbac.authorization.k8s.io")
    assert not can(kube_api, operator_user, "escalate", "clusterroles", group="rbac.authorization.k8s.io")

    operator = _start_operator(kube, kube_api, ns, tmp_path, operators, fullname=fullname)
    assert operator.argv[1] == "--all-namespaces"
    _apply_example(kube, elsewhere, "far")
    deployment = _reconciled(kube_api, elsewhere, "far")
    assert deployment.metadata.namespace == elsewhere
    kube.kubectl("delete", "agentdispatch", "far", "-n", elsewhere, "--timeout=60s")
    assert operator.forbidden(about=(ns, elsewhere, "cluster scope")) == [], operator.tail()


def test_helm_upgrade_changes_the_operator_and_leaves_agentdispatches_alone(
    helm_bin: Path,
    kube: ControlPlane,
    kube_api: client.ApiClient,
    kube_namespace: str,
    installer: Callable[..., str],
    operators: list[ChartOperator],
    tmp_path: Path,
) -> None:
    ns = kube_namespace
    installer(ns)
    operator = _start_operator(kube, kube_api, ns, tmp_path, operators)
    _apply_example(kube, ns)
    _reconciled(kube_api, ns)
    assert operator.forbidden() == [], operator.tail()
    # Recreate stops the old operator before the new pod starts; the snapshot is taken then, so
    # nothing but the upgrade can change what is compared below.
    operator.stop()
    worker_before = get_deployment(kube_api, ns, "example-worker")
    ad_before = get_ad(kube_api, ns, "example")
    assert ad_before is not None
    crd_before = client.ApiextensionsV1Api(kube_api).read_custom_resource_definition(CRD_NAME)
    operator_before = get_deployment(kube_api, ns, f"{RELEASE}-operator")

    helm(
        helm_bin,
        tmp_path / "helm",
        kube,
        "upgrade",
        RELEASE,
        str(CHART),
        "--namespace",
        ns,
        "--reuse-values",
        "--set",
        "operator.logLevel=DEBUG,image.tag=0.1.1",
    )
    operator_after = get_deployment(kube_api, ns, f"{RELEASE}-operator")
    container = operator_after.spec.template.spec.containers[0]
    assert operator_after.metadata.generation == operator_before.metadata.generation + 1
    assert container.image == "agent-dispatch:0.1.1"
    assert {e.name: e.value for e in container.env}["AGENT_DISPATCH_LOG_LEVEL"] == "DEBUG"
    assert operator_after.spec.strategy.type == "Recreate"

    # The running AgentDispatch, its workers and the CRD were not touched by the upgrade.
    ad_after = get_ad(kube_api, ns, "example")
    assert ad_after is not None
    for key in ("uid", "generation", "resourceVersion", "creationTimestamp"):
        assert ad_after["metadata"][key] == ad_before["metadata"][key], key
    assert ad_after["spec"] == ad_before["spec"]
    worker_after = get_deployment(kube_api, ns, "example-worker")
    assert worker_after.metadata.uid == worker_before.metadata.uid
    assert worker_after.metadata.generation == worker_before.metadata.generation
    crd_after = client.ApiextensionsV1Api(kube_api).read_custom_resource_definition(CRD_NAME)
    assert crd_after.metadata.resource_version == crd_before.metadata.resource_version


def test_helm_uninstall_leaves_nothing_but_the_crd(
    helm_bin: Path,
    kube: ControlPlane,
    kube_api: client.ApiClient,
    kube_namespace: str,
    operators: list[ChartOperator],
    tmp_path: Path,
) -> None:
    ns = kube_namespace
    home = tmp_path / "helm"
    helm(helm_bin, home, kube, "install", RELEASE, str(CHART), "--namespace", ns)
    crd_established(kube)
    _start_operator(kube, kube_api, ns, tmp_path, operators)
    _apply_example(kube, ns)
    _reconciled(kube_api, ns)

    kube.kubectl("delete", "agentdispatch", "example", "-n", ns, "--timeout=60s")
    helm(helm_bin, home, kube, "uninstall", RELEASE, "--namespace", ns, "--wait", "--timeout=60s")

    wait_for(lambda: leftovers(kube, ns) == [], 60, what=f"no leftovers; found {leftovers(kube, ns)}")
    crd = client.ApiextensionsV1Api(kube_api).read_custom_resource_definition(CRD_NAME)
    assert crd.metadata.name == CRD_NAME  # Helm never deletes crds/ (by design; see docs/operations.md)
    assert helm(helm_bin, home, kube, "status", RELEASE, "--namespace", ns, check=False).returncode != 0


def test_worker_service_account_is_bound_by_the_worker_role(
    kube: ControlPlane, kube_api: client.ApiClient, kube_namespace: str, installer: Callable[..., str]
) -> None:
    """The worker's token can create, renew and delete its Lease, and nothing beyond Leases."""
    ns = kube_namespace
    installer(ns)
    kubeconfig = kube.kubeconfig_for_token(service_account_token(kube_api, ns, WORKER_SA), f"{ns}-w")
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "w-1", "namespace": ns},
        "spec": {"holderIdentity": "w-1", "leaseDurationSeconds": 30},
    }
    kube.kubectl("create", "-f", "-", input=json.dumps(lease), kubeconfig=kubeconfig)
    kube.kubectl(
        "patch",
        "lease",
        "w-1",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"leaseDurationSeconds":60}}',
        kubeconfig=kubeconfig,
    )
    kube.kubectl("delete", "lease", "w-1", "-n", ns, kubeconfig=kubeconfig)
    denied = kube.kubectl("get", "deployments", "-n", ns, kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()


def test_agentdispatch_served_by_the_installed_crd(
    kube: ControlPlane, kube_api: client.ApiClient, kube_namespace: str, installer: Callable[..., str]
) -> None:
    """`kubectl get agentdispatch` (and the short name) works after helm install, with the printer
    columns the README shows."""
    installer(kube_namespace)
    _apply_example(kube, kube_namespace)
    table = kube.kubectl("get", "adx", "-n", kube_namespace).stdout
    header = table.splitlines()[0].split()
    assert header == ["NAME", "BACKEND", "DEPTH", "WORKERS", "READY", "AGE"]
    assert table.splitlines()[1].split()[:2] == ["example", "sqlite"]
    with contextlib.suppress(ApiException):
        client.CustomObjectsApi(kube_api).delete_namespaced_custom_object(
            GROUP, VERSION, kube_namespace, PLURAL, "example"
        )


def test_subject_access_reviews_bound_the_metrics_api(
    kube_api: client.ApiClient, kube_namespace: str, installer: Callable[..., str]
) -> None:
    """The metrics API may read AgentDispatch objects where the operator watches, review tokens and
    access, and read the front-proxy ConfigMap; nothing else. The HPA controller may read it."""
    ns, other = kube_namespace, "default"
    installer(ns)
    api = service_account_user(ns, f"{RELEASE}-metrics-api")
    hpa = service_account_user("kube-system", "horizontal-pod-autoscaler")
    metric = "agent_dispatch_queue_depth"

    def allowed(subject: tuple[str, list[str]], verb: str, resource: str, **kw: Any) -> bool:
        return can(kube_api, subject, verb, resource, **kw)

    assert allowed(api, "list", PLURAL, group=GROUP, namespace=ns)
    assert allowed(api, "watch", PLURAL, group=GROUP, namespace=ns)
    assert allowed(api, "create", "subjectaccessreviews", group="authorization.k8s.io")
    assert allowed(api, "create", "tokenreviews", group="authentication.k8s.io")
    assert allowed(
        api, "get", "configmaps", namespace="kube-system", name="extension-apiserver-authentication"
    )
    assert allowed(hpa, "list", metric, group="external.metrics.k8s.io", namespace=ns)
    assert allowed(hpa, "get", metric, group="external.metrics.k8s.io", namespace=other)
    excess = {
        "list AgentDispatches elsewhere": allowed(api, "list", PLURAL, group=GROUP, namespace=other),
        "patch AgentDispatches": allowed(api, "patch", PLURAL, group=GROUP, namespace=ns),
        "patch AgentDispatch status": allowed(
            api, "patch", PLURAL, group=GROUP, namespace=ns, subresource="status"
        ),
        "read Secrets": allowed(api, "get", "secrets", namespace=ns, name="agent-dispatch-metrics-api-tls"),
        "list Secrets": allowed(api, "list", "secrets", namespace=ns),
        "read another kube-system ConfigMap": allowed(
            api, "get", "configmaps", namespace="kube-system", name="kube-proxy"
        ),
        "create Pods": allowed(api, "create", "pods", namespace=ns),
        "update Deployments": allowed(api, "patch", "deployments", group="apps", namespace=ns),
        "impersonate": allowed(api, "impersonate", "users"),
        "create ClusterRoleBindings": allowed(
            api, "create", "clusterrolebindings", group="rbac.authorization.k8s.io"
        ),
        "read external metrics itself": allowed(
            api, "list", metric, group="external.metrics.k8s.io", namespace=ns
        ),
        "anyone reads external metrics": allowed(
            service_account_user(ns, "default"), "list", metric, group="external.metrics.k8s.io", namespace=ns
        ),
        "HPA controller writes external metrics": allowed(
            hpa, "create", metric, group="external.metrics.k8s.io", namespace=ns
        ),
    }
    assert [what for what, yes in excess.items() if yes] == []
